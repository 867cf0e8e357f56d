//! Typed answers of the LMCache frontend, encoded to LMCache's exact frames at the edge.

use super::wire::{self, SlotDesc};

/// Outcome of one LMCache request: the reply payload frame, or `None` for "no frame" (LMCache's
/// reply to handlers that return None).
pub type Reply = Option<Vec<u8>>;

/// The typed answer to one LMCache request, before encoding (what the simulator reads).
/// Invariant: [`LmReply::encode`] gives the exact frame LMCache's own server sends for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LmReply {
    /// No reply frame (handlers that return None in LMCache).
    Nothing,
    /// An unsigned integer.
    Uint(u64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// A list of strings.
    StrList(Vec<String>),
    /// PREPARE_STORE: slots and the chunk indices they are for (`None`: pickle mode).
    PrepareStore(Option<(Vec<SlotDesc>, Vec<u32>)>),
    /// PREPARE_RETRIEVE: the slots of a hit, `None` for a miss.
    PrepareRetrieve(Option<Vec<SlotDesc>>),
    /// REGISTER: the segment name and pool size.
    Register {
        /// POSIX shm segment name.
        shm_name: String,
        /// Pool bytes.
        pool_bytes: u64,
    },
    /// The GPU-path STORE/RETRIEVE negative answer.
    BinBool(bool),
}

impl LmReply {
    /// The reply frame.
    pub fn encode(&self) -> Reply {
        Some(match self {
            LmReply::Nothing => return None,
            LmReply::Uint(v) => wire::encode_uint(*v),
            LmReply::Bool(v) => wire::encode_bool(*v),
            LmReply::Str(v) => wire::encode_str(v),
            LmReply::StrList(v) => {
                let items: Vec<&str> = v.iter().map(String::as_str).collect();
                wire::encode_str_list(&items)
            }
            LmReply::PrepareStore(None) => wire::encode_prepare_store_reply(None),
            LmReply::PrepareStore(Some((d, c))) => wire::encode_prepare_store_reply(Some((d, c))),
            LmReply::PrepareRetrieve(v) => wire::encode_prepare_retrieve_reply(v.as_deref()),
            LmReply::Register {
                shm_name,
                pool_bytes,
            } => wire::encode_register_reply(shm_name, *pool_bytes),
            LmReply::BinBool(ok) => wire::encode_bin_bool(&[0u8; 64], *ok),
        })
    }
}
