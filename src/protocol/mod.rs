//! The native wire protocol: a fixed header plus rkyv-archived payloads.

pub mod budget;
pub mod frame;
pub mod messages;
pub mod reader;

pub use self::frame::{FrameError, FrameHeader, MAX_PAYLOAD_BYTES};
pub use self::messages::{
    BlockAllocationRecord, ChunkRange, DataPath, RegisterReply, RegisterRequest, RemoteBuf,
    RemoteRegion, Request, Response, WireLayout, WireSlot,
};
