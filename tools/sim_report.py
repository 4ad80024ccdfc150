#!/usr/bin/env python3
"""Run `deepinfer simulate` over the experiment grid of benches/results/<date>-scheduler and
write the raw JSON lines plus a markdown summary.

    python3 tools/sim_report.py --bin target/release/deepinfer \
        --trace crates/kv/tests/fixtures/conversation_trace.jsonl.gz --out benches/results/2026-11-29-scheduler
"""
import argparse, json, os, subprocess

def run(binary, trace, *args):
    out = subprocess.run([binary, "simulate", "--trace", trace, *args], check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    r.pop("config")
    r["args"] = " ".join(args)
    return r

def row(r):
    return (f"| `{r['args']}` | {r['completed']} | {r['ttft_s']['p50']:.2f} / {r['ttft_s']['p90']:.2f} / {r['ttft_s']['p99']:.2f} "
            f"| {1e3*r['tpot_s']['p50']:.1f} / {1e3*r['tpot_s']['p90']:.1f} / {1e3*r['tpot_s']['p99']:.1f} "
            f"| **{r['goodput']:.3f}** | {r['prefix_hit_rate']:.3f} | {r['utilisation']:.2f} |")

HEAD = ("| arguments | completed | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | goodput | prefix hit | utilisation |\n"
        "|---|---|---|---|---|---|---|")

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--azure", help="Azure LLM 2023 CSV trace, for one more section")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sections = []
    raw = []
    policies = ["ours", "least-loaded", "round-robin", "cache-affinity"]
    for rate in ["8", "12", "16"]:
        rows = [run(a.bin, a.trace, "--prefill", "2", "--decode", "2", "--policy", p, "--rate-scale", rate) for p in policies]
        rows += [run(a.bin, a.trace, "--prefill", "2", "--decode", "2", "--colocated", "--policy", p, "--rate-scale", rate) for p in policies]
        sections.append((f"Policies, 4 replicas, rate x{rate}", rows))
        raw += rows
    rows = []
    for n in [4, 6, 8]:
        for p in range(1, n):
            rows.append(run(a.bin, a.trace, "--prefill", str(p), "--decode", str(n - p), "--rate-scale", str(4 * n)))
        rows.append(run(a.bin, a.trace, "--prefill", str(n // 2), "--decode", str(n - n // 2), "--colocated", "--rate-scale", str(4 * n)))
    sections.append(("Disaggregated vs co-located at equal GPU count (n replicas of 8 H200, rate x4n, policy ours)", rows))
    raw += rows
    rows = [run(a.bin, a.trace, "--prefill", "2", "--decode", "2", "--rate-scale", "12", "--prefix-cache-blocks", c) for c in ["0", "1000", "5000", "20000", "100000", "unlimited"]]
    sections.append(("TTFT against prefix-cache capacity (2P + 2D, rate x12)", rows))
    raw += rows
    if a.azure:
        rows = [run(a.bin, a.azure, "--prefill", "2", "--decode", "2", "--policy", p, "--rate-scale", "4") for p in policies[:3]]
        rows += [run(a.bin, a.azure, "--prefill", "2", "--decode", "2", "--colocated", "--policy", p, "--rate-scale", "4") for p in policies[:3]]
        sections.append(("Azure LLM 2023 conversation trace (no prefix data), 4 replicas, rate x4", rows))
        raw += rows
    with open(os.path.join(a.out, "simulate.jsonl"), "w") as f:
        for r in raw:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(a.out, "tables.md"), "w") as f:
        for title, rows in sections:
            f.write(f"### {title}\n\n{HEAD}\n" + "\n".join(row(r) for r in rows) + "\n\n")
    print(open(os.path.join(a.out, "tables.md")).read())

if __name__ == "__main__":
    main()
