//! Speculative decoding: drafters (the MTP head, DSpark-style block drafters), lossless
//! verification by rejection sampling, and confidence-scheduled choice of how many drafts each
//! request verifies per step. Logic over token ids and probabilities; no device types.
