//! The KV tiers below device memory: host memory, then a directory (a local disk, or a shared or
//! distributed file system such as 3FS or NFS when replicas span machines), and the store that
//! moves blocks between them in the background.

mod disk;
mod host;
mod store;

pub use disk::{DiskStats, DiskTier, Retention};
pub use host::HostTier;
pub use store::{StoreStats, TieredStore};

/// How long a block is kept in the durable tier, by the kind of traffic that produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheClass {
    /// Agent traffic: long tool loops revisit a prefix within hours (default 3 days).
    Agent,
    /// Chat traffic: users come back to a conversation over days (default 7 days).
    Chat,
}

impl CacheClass {
    pub(crate) fn code(self) -> u8 {
        match self {
            CacheClass::Agent => 1,
            CacheClass::Chat => 2,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<CacheClass> {
        match c {
            1 => Some(CacheClass::Agent),
            2 => Some(CacheClass::Chat),
            _ => None,
        }
    }
}
