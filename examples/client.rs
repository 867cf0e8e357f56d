//! A minimal engine: connect to a running node, register, store a prompt's chunks, read them back.
//! Run it against a node: `cargo run --example client -- /tmp/kvnode.sock`.

use std::path::Path;

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::protocol::RegisterRequest;

fn main() -> Result<(), kvnode::Error> {
    let socket = std::env::args_os()
        .nth(1)
        .map(Into::into)
        .unwrap_or_else(kvnode::config::default_socket_path);
    round_trip(&socket)?;
    println!("stored and retrieved through {}", socket.display());
    Ok(())
}

/// Registers instance 1, stores every chunk of a 512-token prompt and checks it reads back.
pub fn round_trip(socket: &Path) -> Result<(), kvnode::Error> {
    let mut client = Client::connect(socket)?;
    // Receives the pool fd and maps the pool: chunks are copied straight into it.
    client.register(&RegisterRequest {
        instance_id: 1,
        model: "my-model".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim: 128,
        dtype: "bfloat16".into(),
        use_mla: false,
        physical_slots: None, // token slots per chunk object; None = chunk size
    })?;
    // Chunk keys are hashed on the client, as LMCache does (rolling BLAKE3 over the tokens).
    let tokens: Vec<u32> = (0..512).collect();
    let range = ChunkRangeBuilder::worker("my-model", 1, 0).tokens(&tokens, client.chunk_tokens()?);
    let len = client.object_bytes()? as usize; // one chunk's KV for this layout
    let chunks: Vec<Vec<u8>> = (0..range.chunk_hashes.len())
        .map(|i| vec![i as u8; len])
        .collect();
    let refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    client.store(1, &range, &refs)?;
    let back = client.retrieve(1, &range)?.expect("every chunk was stored");
    assert_eq!(back, chunks);
    Ok(())
}
