//! The README's GPU example: an engine storing KV chunks from device memory and reading them
//! back into device memory (`cargo run --example gpu_client -- /tmp/kvnode.sock` on a host
//! with a GPU; the tests run `round_trip_gpu` with the simulated GPU).

use std::path::Path;

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::protocol::RegisterRequest;
use kvnode_hw::gpu::Gpu;

fn main() -> Result<(), kvnode::Error> {
    let socket = std::env::args_os()
        .nth(1)
        .map(Into::into)
        .unwrap_or_else(kvnode::config::default_socket_path);
    let gpu = Gpu::open(0)?; // probes first: without a GPU, an error saying why
    round_trip_gpu(&socket, &gpu)?;
    println!("stored from and retrieved into {}", gpu.info().name);
    Ok(())
}

/// Stores 8 chunks from device memory and retrieves them into another device buffer.
pub fn round_trip_gpu(socket: &Path, gpu: &Gpu) -> Result<(), kvnode::Error> {
    let mut client = Client::connect(socket)?;
    client.attach_gpu(gpu)?; // this client's own CUDA stream
    client.register(&RegisterRequest {
        instance_id: 1,
        model: "my-model".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim: 128,
        dtype: "bfloat16".into(),
        use_mla: false,
        physical_slots: None,
    })?; // maps the pool and registers it with the GPU driver (once per process)
    let tokens: Vec<u32> = (0..8 * client.chunk_tokens()?).collect();
    let range = ChunkRangeBuilder::worker("my-model", 1, 0).tokens(&tokens, client.chunk_tokens()?);
    let n = client.object_bytes()?;
    // The engine's KV chunks in device memory (an engine wraps its own tensor with the unsafe
    // `DeviceBuffer::from_raw(gpu, ptr, len)` instead).
    let kv = gpu.alloc(8 * n)?;
    kv.write(0, &vec![7u8; (8 * n) as usize])?;
    // One asynchronous copy per chunk into its slot, one wait, then the commit.
    client.store_from_device(1, &range, &kv.chunks(n, 8)?)?;
    let back = gpu.alloc(8 * n)?;
    assert!(client.retrieve_to_device(1, &range, None, &back.chunks(n, 8)?)?);
    let mut host = vec![0u8; (8 * n) as usize];
    back.read(0, &mut host)?;
    assert!(host.iter().all(|&b| b == 7));
    Ok(())
}
