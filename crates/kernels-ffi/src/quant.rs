//! Decoding of the checkpoint's storage formats to f32 (MODEL_V4.md §10.1), and the official
//! runtime rounding (§10.1 "official runtime numerics", §6.3): the model's `Numerics::Official`
//! and the CPU references of the FP8/FP4 GEMM kernels use them.
//!
//! * FP8 e4m3fn: bias 7, no infinities, max 448, NaN = 0x7F / 0xFF.
//! * ue8m0 scale: 2^(byte − 127).
//! * FP4 e2m1: sign bit 3, magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]; byte j of a row holds element
//!   2j in the low nibble and 2j+1 in the high nibble.

/// Value of an FP8 e4m3fn byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Value of a ue8m0 scale byte: 2^(b − 127). 0xFF is NaN.
pub fn e8m0_to_f32(b: u8) -> f32 {
    if b == 0xff {
        f32::NAN
    } else {
        2f32.powi(b as i32 - 127)
    }
}

/// An e4m3 byte from random bits, never NaN (0x7F/0xFF become 0x7E/0xFE): test inputs.
pub fn random_e4m3(bits: u64) -> u8 {
    let b = bits as u8;
    if b & 0x7f == 0x7f {
        b ^ 1
    } else {
        b
    }
}

/// FP4 e2m1 code -> value.
pub const FP4_LUT: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Eight e2m1 codes (a little-endian word of a packed FP4 row, element i in bits 4i..4i+3) as the
/// four f16 pairs the CUDA FP4 decode kernels feed their f16 MMAs (`fp4x8_to_f16_lo14` in
/// kernels/cuda/gemm.cu, the same bit operations): pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7),
/// low half first, each value times 2^-14. A code s|e1 e0|m placed at bits 15 and 11..9 of a half is
/// the f16 s|0 0 0 e1 e0|m 0..0, exactly the code's value times 2^-14 (0.5, e = 0, is an f16
/// subnormal); the kernels multiply the 2^14 back into the activation scale.
pub fn fp4x8_to_f16_pairs_lo14(w: u32) -> [u32; 4] {
    [
        ((w << 9) & 0x0E00_0E00) | ((w << 12) & 0x8000_8000),
        ((w << 5) & 0x0E00_0E00) | ((w << 8) & 0x8000_8000),
        ((w << 1) & 0x0E00_0E00) | ((w << 4) & 0x8000_8000),
        ((w >> 3) & 0x0E00_0E00) | (w & 0x8000_8000),
    ]
}

/// Eight e2m1 codes as the four bf16 pairs the Hopper grouped FP4 prefill GEMM widens them to
/// (`fp4x8_to_bf16_pairs` in kernels/cuda/gemm_sm90.cu, the same bit operations, before its scale
/// multiply): pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7), low half first, each value times
/// 2^-126. A code s|e1 e0|m placed at bits 15 and 8..6 of a bf16 is s|0..0 e1 e0|m 0..0, exactly
/// the code's value times 2^-126 (0.5 is a bf16 subnormal); the kernel then multiplies by 2^(s-1)
/// for the group's ue8m0 scale s <= 128, which is exact.
pub fn fp4x8_to_bf16_pairs_lo126(w: u32) -> [u32; 4] {
    [
        ((w << 6) & 0x01C0_01C0) | ((w << 12) & 0x8000_8000),
        ((w << 2) & 0x01C0_01C0) | ((w << 8) & 0x8000_8000),
        ((w >> 2) & 0x01C0_01C0) | ((w << 4) & 0x8000_8000),
        ((w >> 6) & 0x01C0_01C0) | (w & 0x8000_8000),
    ]
}

/// Eight e2m1 codes as the two words of e4m3 bytes the Hopper grouped FP4 decode GEMM widens them
/// to (`fp4x8_to_e4m3_lo6` in kernels/cuda/lowp.cuh, the same bit operations): codes 0, 2, 4, 6 in
/// the bytes of the first word, codes 1, 3, 5, 7 in the second, each value times 2^-6. A code
/// s|e1 e0|m placed at bits 7 and 4..2 of a byte is the e4m3 s|0 0 e1 e0|m 0 0, exactly the code's
/// value times 2^-6 (0.5, e = 0, is an e4m3 subnormal); the kernel multiplies the 2^6 back into
/// the activation scale.
pub fn fp4x8_to_e4m3_lo6(w: u32) -> [u32; 2] {
    [((w & 0x0707_0707) << 2) | ((w & 0x0808_0808) << 4), ((w >> 2) & 0x1C1C_1C1C) | (w & 0x8080_8080)]
}

/// 2^ceil(log2(q)) for a normal positive q from its bits, as the kernels compute their activation
/// scales (`pow2_ceil` in kernels/cuda/lowp.cuh, the same bit operations): the biased exponent,
/// plus one unless the mantissa is zero. Exact, where `log2` in f32 can round a quotient just above
/// a power of two down onto it.
pub fn pow2_ceil_bits(q: f32) -> f32 {
    let b = q.to_bits();
    f32::from_bits(((b >> 23) + u32::from(b & 0x7f_ffff != 0)) << 23)
}

/// 1 / s for a power of two s in 2^-125..=2^126 from its bits (`pow2_recip` in lowp.cuh): 254 less
/// the biased exponent.
pub fn pow2_recip_bits(s: f32) -> f32 {
    f32::from_bits((254 << 23) - s.to_bits())
}

/// (a / d, a % d) through the float quotient of a + 1/2 (`div_small` in lowp.cuh), inv = 1 / d in
/// f32. Exact for a * d < 2^22: the quotient is then off by less than 1 / (2 d), the distance of
/// (a + 1/2) / d from the integers.
pub fn div_small(a: u32, d: u32, inv: f32) -> (u32, u32) {
    let q = ((a as f32 + 0.5) * inv) as u32;
    (q, a - q * d)
}

/// Where element k of an x row goes in the shared-memory copy the Hopper grouped FP4 decode GEMM
/// multiplies (`f4d_round_x` in gemm_sm90.cu): within each 32-wide group (one wgmma k step, one
/// FP4 scale group), the even k first, then the odd ones: slot j holds k = 2 j for j < 16 and 2 (j - 16) + 1 after. That
/// is the k-slot order of the wgmma A fragment that [`fp4x8_to_e4m3_lo6`] fills: thread q's slots
/// 4 q.. take the even codes of its word (bytes 4 q.. of the group's 16), slots 16 + 4 q.. the odd.
pub fn fp4_dec_x_position(k: usize) -> usize {
    let b = k % 32;
    k - b + if b.is_multiple_of(2) { b / 2 } else { 16 + b / 2 }
}

/// Where element k of an x row goes in the copy the Hopper grouped FP4 prefill GEMM reads
/// (`di_quantize_fp8_rows` with `permute`): within each 64-wide block, k = 16 q + 8 h + 4 e + kk goes
/// to 16 kk + 2 q + e + 8 h. That is the k of the wgmma A-fragment slot (k block kk, column
/// 2 q + e + 8 h) that math thread q fills from nibble kk + 4 e of word h of its 8 bytes of a W row
/// (bytes 8 q to 8 q + 7 of the block's 32: codes of k = 16 q to 16 q + 15, one scale group).
pub fn fp4_wgmma_x_position(k: usize) -> usize {
    let b = k % 64;
    let (q, h, e, kk) = (b / 16, (b / 8) % 2, (b / 4) % 2, b % 4);
    k - b + 16 * kk + 2 * q + e + 8 * h
}

/// Dequantise an FP8 [n, k] weight with ue8m0 scales over [bn, bk] blocks.
pub fn dequant_fp8_blocks(q: &[u8], scale: &[u8], n: usize, k: usize, block: [usize; 2]) -> Vec<f32> {
    let kb = k.div_ceil(block[1]);
    let mut out = Vec::with_capacity(n * k);
    for r in 0..n {
        for c in 0..k {
            out.push(e4m3_to_f32(q[r * k + c]) * e8m0_to_f32(scale[(r / block[0]) * kb + c / block[1]]));
        }
    }
    out
}

/// Dequantise a packed FP4 [n, k] weight (bytes [n, k/2]) with ue8m0 scales per 32 elements.
pub fn dequant_fp4_rows(packed: &[u8], scale: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * k);
    for r in 0..n {
        for c in 0..k {
            let byte = packed[r * (k / 2) + c / 2];
            let code = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            out.push(FP4_LUT[code as usize] * e8m0_to_f32(scale[r * (k / 32) + c / 32]));
        }
    }
    out
}

/// Round to the nearest e4m3fn value (ties to even), saturating at ±448.
pub fn round_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs().min(448.0);
    if a == 0.0 {
        return 0.0f32.copysign(x);
    }
    // Spacing of e4m3 values near a: subnormals below 2^-6 are spaced 2^-9.
    let e = a.log2().floor().max(-6.0) as i32;
    let step = 2f32.powi(e - 3);
    let r = (a / step).round_ties_even() * step;
    r.min(448.0).copysign(x)
}

/// Round to the nearest e2m1 magnitude (ties to even code), clamped at ±6.
pub fn round_e2m1(x: f32) -> f32 {
    let a = x.abs().min(6.0);
    let mut best = 0usize;
    for (i, v) in FP4_LUT[..8].iter().enumerate() {
        let (d, db) = ((a - v).abs(), (a - FP4_LUT[best]).abs());
        if d < db || (d == db && i % 2 == 0 && best % 2 == 1) {
            best = i;
        }
    }
    FP4_LUT[best].copysign(x)
}

/// Power-of-two scale 2^ceil(log2(amax / qmax)) of a block, amax floored at `floor`.
fn pow2_scale(block: &[f32], qmax: f32, floor: f32) -> f32 {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(floor);
    2f32.powf((amax / qmax).log2().ceil())
}

/// The e4m3fn byte of a value e4m3 represents exactly (the output of [`round_e4m3`]).
pub fn e4m3_code(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a == 0.0 {
        return sign;
    }
    if a < 2f32.powi(-6) {
        // Subnormal: a = man / 8 * 2^-6.
        return sign | (a / 2f32.powi(-9)) as u8;
    }
    let e = a.log2().floor() as i32;
    let man = ((a / 2f32.powi(e) - 1.0) * 8.0).round() as u8;
    sign | (((e + 7) as u8) << 3) | man
}

/// FP8 quantisation in blocks of `block` values with power-of-two scales: the e4m3 codes and one
/// scale per block. Code times scale is exactly the value [`fp8_round_trip`] leaves.
pub fn fp8_quantize(x: &[f32], block: usize, amax_floor: f32) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len().div_ceil(block));
    for b in x.chunks(block) {
        let s = pow2_scale(b, 448.0, amax_floor);
        scales.push(s);
        codes.extend(b.iter().map(|v| e4m3_code(round_e4m3(*v / s))));
    }
    (codes, scales)
}

/// FP8 round trip in blocks of `block` values with ue8m0 scales (activation quantisation before
/// FP8/FP4 GEMMs uses 128, the KV QAT 64).
pub fn fp8_round_trip(x: &mut [f32], block: usize, amax_floor: f32) {
    for b in x.chunks_mut(block) {
        let s = pow2_scale(b, 448.0, amax_floor);
        for v in b.iter_mut() {
            *v = round_e4m3(*v / s) * s;
        }
    }
}

/// FP4 round trip in blocks of 32 with ue8m0 scales (the indexer QAT, MODEL_V4.md §6.3).
pub fn fp4_round_trip(x: &mut [f32]) {
    for b in x.chunks_mut(32) {
        let s = pow2_scale(b, 6.0, 6.0 * 2f32.powi(-126));
        for v in b.iter_mut() {
            *v = round_e2m1(*v / s) * s;
        }
    }
}

/// Normalised Walsh–Hadamard transform (Sylvester order, scale n^-½) of a power-of-two length.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn every_e4m3_value_is_a_fixed_point_of_rounding() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_finite() {
                assert_eq!(round_e4m3(v), v, "byte {b:#x}");
            }
        }
    }

    /// Words of eight e2m1 codes covering each code in each position (the other nibbles cycling
    /// through the codes), then 10,000 words of random bits.
    fn fp4_code_words() -> impl Iterator<Item = u32> {
        let placed = (0..16u32).flat_map(|code| {
            (0..8).map(move |pos| {
                let w = (0..8).fold(0u32, |acc, i| acc | (((code + i) % 16) << (4 * i)));
                w & !(0xF << (4 * pos)) | (code << (4 * pos))
            })
        });
        let random = (0..10_000).scan(0x9E37_79B9_7F4A_7C15u64, |z, _| {
            *z = z.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            Some((*z >> 32) as u32)
        });
        placed.chain(random)
    }

    /// Each element i of word w with the 16 bits its widening gives it (pairs (v0, v4), (v1, v5),
    /// (v2, v6), (v3, v7), low half first), and its code.
    fn fp4_pair_halves(w: u32, pairs: [u32; 4]) -> impl Iterator<Item = (usize, u16, u32)> {
        (0..8).map(move |i| {
            let bits = if i >= 4 { pairs[i % 4] >> 16 } else { pairs[i % 4] & 0xFFFF } as u16;
            (i, bits, (w >> (4 * i)) & 0xF)
        })
    }

    /// The bf16 widening of the Hopper FP4 prefill GEMM: every code in every position lands in its
    /// pair and half as exactly its value times 2^-126, and times 2^(s-1) it is exactly the value
    /// times the ue8m0 scale 2^(s-127), representable in bf16, for every s <= 128.
    #[test]
    fn fp4_codes_as_bf16_pairs_are_exact() {
        let lo126 = 2f32.powi(-126);
        for w in fp4_code_words() {
            for (i, bits, v) in fp4_pair_halves(w, fp4x8_to_bf16_pairs_lo126(w)) {
                let got = half::bf16::from_bits(bits).to_f32();
                let want = FP4_LUT[v as usize] * lo126;
                assert!(
                    got == want && got.is_sign_negative() == want.is_sign_negative(),
                    "word {w:#x} element {i}: {got} != {want}"
                );
                for s in 0..=128u8 {
                    let scaled = got * 2f32.powi(s as i32 - 1);
                    assert_eq!(scaled, FP4_LUT[v as usize] * e8m0_to_f32(s), "code {v} scale {s}");
                    assert_eq!(half::bf16::from_f32(scaled).to_f32(), scaled, "code {v} scale {s} not exact in bf16");
                }
            }
        }
    }

    /// The x order of the Hopper FP4 prefill GEMM is a permutation of each 64-wide block, and the
    /// slot that math thread q fills from nibble j of word h of its bytes holds that code's k.
    #[test]
    fn fp4_wgmma_x_order_matches_the_fragments() {
        for base in [0usize, 64, 4032] {
            let mut seen = [false; 64];
            for k in base..base + 64 {
                let p = fp4_wgmma_x_position(k);
                assert!((base..base + 64).contains(&p), "k {k} -> {p}");
                assert!(!seen[p - base], "k {k}: position {p} taken twice");
                seen[p - base] = true;
            }
        }
        for q in 0..4 {
            for h in 0..2 {
                for j in 0..8 {
                    // Nibble j of word h of thread q's bytes 8 q .. 8 q + 7: k = 16 q + 8 h + j.
                    let k = 16 * q + 8 * h + j;
                    // The widening pairs nibbles kk and kk + 4 of a word into A-fragment register kk
                    // (word 0: columns 2 q, 2 q + 1; word 1: 2 q + 8, 2 q + 9 of k block kk).
                    let (kk, e) = (j % 4, j / 4);
                    assert_eq!(fp4_wgmma_x_position(k), 16 * kk + 2 * q + e + 8 * h, "q {q} h {h} nibble {j}");
                }
            }
        }
    }

    /// Every e2m1 code in every position of a word lands in its pair and half as exactly its value
    /// times 2^-14 (the CUDA FP4 decode kernels' f16 operands), and every finite e4m3 value (the
    /// rounded activations they multiply) is exact in f16.
    #[test]
    fn fp4_codes_as_f16_pairs_are_exact() {
        let lo14 = 2f32.powi(-14);
        for w in fp4_code_words() {
            for (i, bits, v) in fp4_pair_halves(w, fp4x8_to_f16_pairs_lo14(w)) {
                let got = half::f16::from_bits(bits).to_f32();
                let want = FP4_LUT[v as usize] * lo14;
                assert!(
                    got == want && got.is_sign_negative() == want.is_sign_negative(),
                    "word {w:#x} element {i}: {got} != {want}"
                );
            }
        }
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_finite() {
                assert_eq!(half::f16::from_f32(v).to_f32(), v, "e4m3 byte {b:#x}");
            }
        }
    }

    /// The e4m3 widening of the Hopper FP4 decode GEMM: every code in every position lands in its
    /// word (evens first, odds second) and byte as exactly its value times 2^-6.
    #[test]
    fn fp4_codes_as_e4m3_bytes_are_exact() {
        let lo6 = 2f32.powi(-6);
        for w in fp4_code_words() {
            let words = fp4x8_to_e4m3_lo6(w);
            for i in 0..8 {
                let byte = (words[i % 2] >> (8 * (i / 2))) as u8;
                let got = e4m3_to_f32(byte);
                let want = FP4_LUT[((w >> (4 * i)) & 0xF) as usize] * lo6;
                assert!(
                    got == want && got.is_sign_negative() == want.is_sign_negative(),
                    "word {w:#x} element {i}: byte {byte:#x} is {got}, want {want}"
                );
            }
        }
    }

    /// The decode GEMM's x order is a permutation within each 32-wide group, and slot j of a group
    /// holds the element the widened W byte in slot j multiplies: word q of the group's four holds
    /// elements 8 q.., its even elements go to slots 4 q.., its odd ones to 16 + 4 q...
    #[test]
    fn fp4_dec_x_positions_match_the_widened_slots() {
        let mut seen = [false; 64];
        for k in 0..64 {
            let p = fp4_dec_x_position(k);
            assert_eq!(p / 32, k / 32, "k {k} left its group");
            assert!(!seen[p], "slot {p} taken twice");
            seen[p] = true;
        }
        for q in 0..4 {
            for i in 0..8 {
                let k = 8 * q + i; // element i of word q
                let slot = if i % 2 == 0 { 4 * q + i / 2 } else { 16 + 4 * q + i / 2 };
                assert_eq!(fp4_dec_x_position(k), slot, "word {q} element {i}");
            }
        }
    }

    #[test]
    fn fp4_nibble_order_low_first() {
        // Row [1.0, -2.0] -> codes 2 and 12 -> byte 0xC2; scale byte 127 = 2^0.
        assert_eq!(dequant_fp4_rows(&[0xc2; 16], &[127], 1, 32)[..2], [1.0, -2.0]);
    }

    #[test]
    fn fp8_block_scales_apply_per_block() {
        // 2x2 weight in 1x1 blocks with scales 2^0, 2^1, 2^2, 2^-1.
        let w = dequant_fp8_blocks(&[0x38; 4], &[127, 128, 129, 126], 2, 2, [1, 1]);
        assert_eq!(w, vec![1.0, 2.0, 4.0, 0.5]);
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let mut x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let norm0: f32 = x.iter().map(|v| v * v).sum();
        hadamard(&mut x);
        let norm1: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm0 - norm1).abs() < 1e-3 * norm0);
        hadamard(&mut x); // H is its own inverse when normalised
        for (i, v) in x.iter().enumerate() {
            assert!((v - (i as f32 * 0.37).sin()).abs() < 1e-5);
        }
    }

    #[test]
    fn round_trips_keep_representable_blocks() {
        let mut x = vec![1.0f32, -0.5, 6.0, 3.0];
        x.resize(32, 0.0);
        let y = x.clone();
        fp4_round_trip(&mut x);
        assert_eq!(x, y);
        let mut z: Vec<f32> = (0..64).map(|i| i as f32 - 32.0).collect();
        let z0 = z.clone();
        fp8_round_trip(&mut z, 64, 1e-4);
        for (a, b) in z.iter().zip(&z0) {
            assert!((a - b).abs() <= b.abs() / 16.0, "{a} vs {b}");
        }
    }

    #[test]
    fn every_e4m3_value_encodes_to_its_own_code() {
        for b in 0u8..=255 {
            if b & 0x7f == 0x7f {
                continue; // NaN
            }
            let v = e4m3_to_f32(b);
            assert_eq!(e4m3_code(v), b, "{b:#04x} = {v}");
        }
    }

    /// The kernels' scale by bits equals 2^ceil(log2 q) computed in f64 (where log2 of a float
    /// that is not a power of two is never an integer) over every exponent, with the mantissas at
    /// and next to the power of two and a spread between.
    #[test]
    fn pow2_ceil_bits_is_the_exact_ceiling() {
        for e in 1u32..254 {
            for m in [0u32, 1, 2, 3, 0x40_0000, 0x12_3457, 0x7f_fffe, 0x7f_ffff] {
                let q = f32::from_bits((e << 23) | m);
                let want = 2f64.powf((q as f64).log2().ceil());
                let got = pow2_ceil_bits(q) as f64;
                assert_eq!(got, want, "q = {q:e} ({:#x})", q.to_bits());
            }
        }
    }

    #[test]
    fn pow2_recip_bits_is_the_reciprocal() {
        for e in -125..=126 {
            let s = 2f32.powi(e);
            assert_eq!(pow2_recip_bits(s), 1.0 / s, "2^{e}");
        }
    }

    /// div_small against integer division over its whole domain for the divisors the kernels use
    /// (rows up to 16, k blocks up to 512), and at the domain's edge for larger divisors.
    #[test]
    fn div_small_is_integer_division_below_its_bound() {
        for d in (1u32..=64).chain([127, 128, 255, 256, 511, 512, 4095]) {
            let inv = 1.0 / d as f32;
            let end = (1u32 << 22) / d;
            let step = if d <= 16 { 1 } else { 7 };
            for a in (0..end).step_by(step).chain(end.saturating_sub(64)..end) {
                assert_eq!(div_small(a, d, inv), (a / d, a % d), "{a} / {d}");
            }
        }
    }

    proptest::proptest! {
        /// Codes times scales are the round trip's values, and rounding again changes nothing (so a
        /// GEMM that re-quantises already quantised activations sees the same values).
        #[test]
        fn fp8_quantize_is_the_round_trip_and_idempotent(
            x in proptest::collection::vec(-1e4f32..1e4, 1..400),
            tiny in proptest::bool::ANY,
        ) {
            let x: Vec<f32> = if tiny { x.iter().map(|v| v * 1e-7).collect() } else { x };
            let (codes, scales) = fp8_quantize(&x, 128, 1e-4);
            let mut r = x.clone();
            fp8_round_trip(&mut r, 128, 1e-4);
            for (i, c) in codes.iter().enumerate() {
                proptest::prop_assert_eq!(e4m3_to_f32(*c) * scales[i / 128], r[i], "value {}", i);
            }
            let mut again = r.clone();
            fp8_round_trip(&mut again, 128, 1e-4);
            proptest::prop_assert_eq!(again, r);
        }
    }
}
