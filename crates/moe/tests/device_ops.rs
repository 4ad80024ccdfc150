//! The device MoE ops on the CPU backend: routing equals `Router` (the definition), and the
//! dispatch is a stable grouping of every routed pair by expert with chunks covering its rows.

use deepinfer_kernels_ffi::moe::{dispatch, route, MoeDispatch, MoeShape, RouteBy, Routed};
use deepinfer_kernels_ffi::Device;
use deepinfer_moe::{Router, RoutingPolicy};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn score_routing_op_equals_router(
        tokens in 1usize..12, experts in 2usize..80, k_frac in 0.0f64..1.0, seed in any::<u64>(),
        scaling in 0.5f32..3.0,
    ) {
        let top_k = ((k_frac * experts.min(16) as f64) as usize).clamp(1, experts.min(16));
        let mut rng = deepinfer_kernels_ffi::testing::SplitMix(seed);
        // Some exact ties and NaNs among the logits.
        let logits: Vec<f32> = (0..tokens * experts)
            .map(|_| match rng.next_u64() % 20 { 0 => f32::NAN, 1 => 0.25, _ => 4.0 * rng.uniform() })
            .collect();
        let bias: Vec<f32> = (0..experts).map(|_| 0.2 * rng.uniform()).collect();
        let s = Device::cpu().default_stream();
        let shape = MoeShape { tokens: tokens as u32, experts: experts as u32, top_k: top_k as u32 };
        let mut out = Routed::new(&s, shape).unwrap();
        let (lb, bb) = (s.upload(&logits).unwrap(), s.upload(&bias).unwrap());
        route(&s, &lb, &RouteBy::Score { bias: Some(&bb) }, scaling, shape, &mut out).unwrap();
        let (ids, w) = (s.download(&out.ids).unwrap(), s.download(&out.weights).unwrap());
        let router = Router::new(experts, top_k, scaling).unwrap();
        for t in 0..tokens {
            let r = router.route(&logits[t * experts..(t + 1) * experts], RoutingPolicy::Score { bias: &bias }).unwrap();
            let got: Vec<u32> = ids[t * top_k..(t + 1) * top_k].iter().map(|v| *v as u32).collect();
            prop_assert_eq!(&got, &r.experts);
            for (a, b) in w[t * top_k..(t + 1) * top_k].iter().zip(&r.weights) {
                prop_assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{} vs {}", a, b);
            }
        }
    }

    #[test]
    fn dispatch_groups_every_routed_pair_stably(
        tokens in 1usize..40, experts in 1usize..40, top_k in 1usize..5, unrouted in 0usize..4, seed in any::<u64>(),
    ) {
        let top_k = top_k.min(experts);
        let mut rng = deepinfer_kernels_ffi::testing::SplitMix(seed);
        let pairs = tokens * top_k;
        let mut ids: Vec<i32> = (0..pairs).map(|_| (rng.next_u64() % experts as u64) as i32).collect();
        for _ in 0..unrouted {
            let at = (rng.next_u64() % pairs as u64) as usize;
            ids[at] = -1;
        }
        let s = Device::cpu().default_stream();
        let shape = MoeShape { tokens: tokens as u32, experts: experts as u32, top_k: top_k as u32 };
        let mut d = MoeDispatch::new(&s, shape).unwrap();
        dispatch(&s, &s.upload(&ids).unwrap(), &mut d).unwrap();
        let off = s.download(&d.offsets).unwrap();
        let row_pair = s.download(&d.row_pair).unwrap();
        let pair_row = s.download(&d.pair_row).unwrap();
        let routed = ids.iter().filter(|e| **e >= 0).count();
        prop_assert_eq!(off[experts] as usize, routed);
        for e in 0..experts {
            let rows = off[e] as usize..off[e + 1] as usize;
            let want: Vec<i32> = (0..pairs as i32).filter(|p| ids[*p as usize] == e as i32).collect();
            prop_assert_eq!(&row_pair[rows.clone()], &want[..], "expert {} rows in pair order", e);
            for r in rows {
                prop_assert_eq!(pair_row[row_pair[r] as usize], r as i32);
            }
        }
        for (p, e) in ids.iter().enumerate() {
            if *e < 0 {
                prop_assert_eq!(pair_row[p], -1);
            }
        }
        prop_assert!(row_pair[routed..].iter().all(|v| *v == 0));
        // Chunks: within capacity, each inside one expert's rows, covering every routed row once.
        let n = s.download(&d.num_chunks).unwrap()[0] as usize;
        prop_assert!(n as u32 <= MoeDispatch::capacity(shape, d.tile));
        let chunks = s.download(&d.chunks).unwrap();
        let mut covered = vec![0u8; routed];
        for c in chunks[..4 * n].chunks(4) {
            let (e, r0, rows) = (c[0] as usize, c[1], c[2]);
            prop_assert!(rows >= 1 && rows as u32 <= d.tile);
            prop_assert!(r0 >= off[e] && r0 + rows <= off[e + 1]);
            for r in r0..r0 + rows {
                covered[r as usize] += 1;
            }
        }
        prop_assert!(covered.iter().all(|c| *c == 1));
    }
}
