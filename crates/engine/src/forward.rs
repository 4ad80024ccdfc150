//! The one trait the engine drives a model through ([`ForwardModel`]), implemented by the reference
//! CPU model ([`crate::Model`]) and the device model ([`crate::device_model::DeviceModel`], cpu
//! backend or CUDA), so the executor, the scheduler, the prefix cache and the recipe layer never
//! fork per device. A sequence's cache state is opaque to the engine ([`SeqState`]): each model
//! keeps its own kind inside.

use std::any::Any;

use deepinfer_kv::{KvError, KvLayout};

use crate::config::ModelConfig;
use crate::device_model::{DeviceModel, DeviceSeq};
use crate::model::{LogitRows, Model, ModelError, Numerics, SequenceState};
use crate::mtp::MtpDrafter;

/// What a model's per-sequence state must offer the engine.
pub trait StateKind: Any + Send {
    /// Tokens processed so far.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One sequence's cache state, as made by the model that runs it.
pub struct SeqState(Box<dyn StateKind>);

impl SeqState {
    pub fn new<S: StateKind>(s: S) -> SeqState {
        SeqState(Box::new(s))
    }

    /// Tokens processed so far (the next token's position).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state as the model's own kind (None for another model's state).
    pub fn get<S: StateKind>(&self) -> Option<&S> {
        self.0.as_any().downcast_ref()
    }

    pub fn get_mut<S: StateKind>(&mut self) -> Option<&mut S> {
        self.0.as_any_mut().downcast_mut()
    }
}

/// A model the engine can run: a varlen forward over per-sequence states, and the prefix cache's
/// view of those states (block payloads in, restored states out).
pub trait ForwardModel: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// Where it runs, for logs and reports (`cpu (reference)`, `cuda:0`).
    fn device_label(&self) -> String;
    fn new_state(&self) -> Result<SeqState, ModelError>;
    /// Logits of each sequence's last new token (each sequence: its new tokens and its state, advanced).
    fn forward_last(&self, batch: &mut [(&[u32], &mut SeqState)]) -> Result<Vec<Vec<f32>>, ModelError>;
    /// The prefix cache's block geometry.
    fn kv_layout(&self, block_tokens: usize) -> Result<KvLayout, KvError>;
    /// Identity of weights and payload encoding: cached blocks of another model are never served.
    fn fingerprint(&self) -> String;
    fn block_tokens_at_least(&self, min: usize) -> usize {
        self.config().block_tokens_at_least(min)
    }
    fn exact_replay_tokens(&self) -> usize {
        self.config().exact_replay_tokens()
    }
    /// The shareable rows of block `block` of a state that has computed them.
    fn block_payload(&self, st: &SeqState, block: usize, block_tokens: usize) -> Result<Vec<u8>, ModelError>;
    /// Time per section of the forward so far (section, seconds, times), where the model measures it.
    fn profile(&self) -> Vec<(String, f64, u64)> {
        Vec::new()
    }
    /// A state holding `blocks` (consecutive from the start) whose next token is `replay_from`.
    fn restore_state(&self, blocks: &[&[u8]], block_tokens: usize, replay_from: usize) -> Result<SeqState, ModelError>;

    /// Speculative decoding's view of the model: a drafter and a forward returning several logit
    /// rows per sequence plus the streams the drafter reads. None where the model has neither
    /// (the engine then decodes without speculation and says so once).
    fn speculation(&self) -> Option<&dyn SpecModel> {
        None
    }
}

/// One sequence's output of [`SpecModel::forward_tails`]: (logits of its tail rows, streams of every row).
pub type TailOut = (Vec<f32>, Vec<f32>);

/// What speculative steps need of a model beyond [`ForwardModel`].
pub trait SpecModel: Send + Sync {
    /// A new drafter over this model.
    fn drafter(&self) -> Result<Box<dyn StreamDrafter + '_>, ModelError>;
    /// Logits of each sequence's last `tails[i]` new rows ([tail, vocab], flattened) and its
    /// final streams for every new row ([T, hc, D]).
    fn forward_tails(&self, batch: &mut [(&[u32], &mut SeqState)], tails: &[usize])
        -> Result<Vec<TailOut>, ModelError>;
    /// An independent copy of a state (a verification runs on the copy; the original stays as the
    /// rollback point when drafts are rejected).
    fn snapshot(&self, st: &SeqState) -> Result<SeqState, ModelError>;
    /// Width of one row of streams (hc · hidden).
    fn stream_width(&self) -> usize;
}

/// A drafter fed by the target's final streams.
pub trait StreamDrafter: deepinfer_spec::Drafter<Error = ModelError> + Send {
    /// The target computed positions `at .. at + rows` of `seq` (their final streams, [rows, hc, D]).
    /// Rows it holds already are skipped; a gap starts the sequence afresh at `at`.
    fn observe_at(&mut self, seq: u64, at: usize, streams: &[f32]) -> Result<(), ModelError>;
    /// Drop everything held for `seq` (it finished).
    fn forget(&mut self, seq: u64);
}

fn wrong_state() -> ModelError {
    ModelError::Input { field: "state", problem: "the state was made by another model".into() }
}

/// `StateKind` for a state type with a `len` field.
macro_rules! state_kind {
    ($($t:ty),*) => {$(
        impl StateKind for $t {
            fn len(&self) -> usize {
                self.len
            }
            fn as_any(&self) -> &dyn Any {
                self
            }
            fn as_any_mut(&mut self) -> &mut dyn Any {
                self
            }
        }
    )*};
}

state_kind!(SequenceState, DeviceSeq);

/// The states of a batch as the model's own kind.
fn own_states<'a, S: StateKind>(
    batch: &'a mut [(&[u32], &mut SeqState)],
) -> Result<Vec<(&'a [u32], &'a mut S)>, ModelError> {
    batch.iter_mut().map(|(t, s)| Ok((*t, s.get_mut::<S>().ok_or_else(wrong_state)?))).collect()
}

impl ForwardModel for Model {
    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }
    fn device_label(&self) -> String {
        "cpu (reference model)".into()
    }
    fn new_state(&self) -> Result<SeqState, ModelError> {
        Ok(SeqState::new(Model::new_state(self)))
    }
    fn forward_last(&self, batch: &mut [(&[u32], &mut SeqState)]) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut own = own_states::<SequenceState>(batch)?;
        let mut b: Vec<(&[u32], &mut SequenceState)> = own.iter_mut().map(|(t, s)| (*t, &mut **s)).collect();
        let (outs, _) = self.forward_rows(&mut b, Numerics::Reference, false, LogitRows::Last)?;
        Ok(outs.into_iter().map(|o| o.logits).collect())
    }
    fn kv_layout(&self, block_tokens: usize) -> Result<KvLayout, KvError> {
        Model::kv_layout(self, block_tokens)
    }
    fn fingerprint(&self) -> String {
        Model::fingerprint(self)
    }
    fn block_payload(&self, st: &SeqState, block: usize, block_tokens: usize) -> Result<Vec<u8>, ModelError> {
        Ok(Model::block_payload(self, st.get::<SequenceState>().ok_or_else(wrong_state)?, block, block_tokens))
    }
    fn restore_state(&self, blocks: &[&[u8]], block_tokens: usize, replay_from: usize) -> Result<SeqState, ModelError> {
        Ok(SeqState::new(Model::restore_state(self, blocks, block_tokens, replay_from)?))
    }
    fn speculation(&self) -> Option<&dyn SpecModel> {
        (self.config().num_mtp_layers > 0).then_some(self as &dyn SpecModel)
    }
}

impl SpecModel for Model {
    fn drafter(&self) -> Result<Box<dyn StreamDrafter + '_>, ModelError> {
        Ok(Box::new(MtpDrafter::new(self, Numerics::Reference)?))
    }
    fn forward_tails(
        &self,
        batch: &mut [(&[u32], &mut SeqState)],
        tails: &[usize],
    ) -> Result<Vec<TailOut>, ModelError> {
        let mut own = own_states::<SequenceState>(batch)?;
        let mut b: Vec<(&[u32], &mut SequenceState)> = own.iter_mut().map(|(t, s)| (*t, &mut **s)).collect();
        let outs = Model::forward_tails(self, &mut b, Numerics::Reference, tails)?;
        Ok(outs.into_iter().map(|o| (o.logits, o.streams)).collect())
    }
    fn snapshot(&self, st: &SeqState) -> Result<SeqState, ModelError> {
        Ok(SeqState::new(st.get::<SequenceState>().ok_or_else(wrong_state)?.clone()))
    }
    fn stream_width(&self) -> usize {
        self.config().hc_mult * self.config().hidden_size
    }
}

impl ForwardModel for DeviceModel {
    fn config(&self) -> &ModelConfig {
        DeviceModel::config(self)
    }
    fn device_label(&self) -> String {
        self.stream().device().label()
    }
    fn new_state(&self) -> Result<SeqState, ModelError> {
        Ok(SeqState::new(self.new_seq()?))
    }
    fn forward_last(&self, batch: &mut [(&[u32], &mut SeqState)]) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut own = own_states::<DeviceSeq>(batch)?;
        let mut b: Vec<(&[u32], &mut DeviceSeq)> = own.iter_mut().map(|(t, s)| (*t, &mut **s)).collect();
        self.forward(&mut b, LogitRows::Last)
    }
    fn kv_layout(&self, block_tokens: usize) -> Result<KvLayout, KvError> {
        self.config().kv_layout(block_tokens, 2)
    }
    fn fingerprint(&self) -> String {
        DeviceModel::fingerprint(self)
    }
    fn block_payload(&self, st: &SeqState, block: usize, block_tokens: usize) -> Result<Vec<u8>, ModelError> {
        DeviceModel::block_payload(self, st.get::<DeviceSeq>().ok_or_else(wrong_state)?, block, block_tokens)
    }
    fn profile(&self) -> Vec<(String, f64, u64)> {
        DeviceModel::profile(self)
    }
    fn restore_state(&self, blocks: &[&[u8]], block_tokens: usize, replay_from: usize) -> Result<SeqState, ModelError> {
        Ok(SeqState::new(DeviceModel::restore_state(self, blocks, block_tokens, replay_from)?))
    }
}
