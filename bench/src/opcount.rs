//! `kvnode-bench __opcount SOCKET OP N`: issues exactly N requests of one type against a node
//! (used by `scripts/bench-callgrind.sh` to count server instructions per request type: the
//! difference between two runs with different N, divided by the difference in N).

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::hashing::chunk_hashes;
use kvnode::protocol::RegisterRequest;

/// Request types the callgrind mode can isolate.
pub const OPS: [&str; 5] = ["ping", "noop", "store", "retrieve", "lookup"];

/// Runs `n` operations of kind `op` (each "store"/"retrieve" is a prepare + commit pair).
pub fn run(socket: &str, op: &str, n: u64) -> Result<(), String> {
    let mut c = Client::connect(socket).map_err(|e| e.to_string())?;
    let id = 0xC0FFEE;
    let reg = c
        .register(&RegisterRequest {
            instance_id: id,
            model: "callgrind".into(),
            world_size: 1,
            block_size: 16,
            num_layers: 2,
            hidden_dim: 128,
            dtype: "float16".into(),
            use_mla: false,
            physical_slots: None,
        })
        .map_err(|e| e.to_string())?;
    let chunk = reg.chunk_tokens;
    let data = vec![7u8; reg.object_bytes as usize];
    let hashes_of = |i: u64| {
        chunk_hashes(
            &(0..chunk).map(|t| t ^ (i as u32) << 8).collect::<Vec<_>>(),
            chunk,
        )
    };
    let worker = ChunkRangeBuilder::worker("callgrind", 1, 0);
    let stored = worker.hashes(0, hashes_of(u64::MAX));
    c.store(id, &stored, &[&data]).map_err(|e| e.to_string())?;
    let all_ranks =
        ChunkRangeBuilder::all_ranks("callgrind", 1).hashes(0, stored.chunk_hashes.clone());
    for i in 0..n {
        match op {
            "ping" => c.ping(Some(id)).map_err(|e| e.to_string())?,
            "noop" => c.noop().map(drop).map_err(|e| e.to_string())?,
            "store" => {
                let r = worker.hashes(0, hashes_of(i));
                let p = c.prepare_store(id, &r).map_err(|e| e.to_string())?;
                c.commit_store(id, p.transfer_id)
                    .map_err(|e| e.to_string())?;
            }
            "retrieve" => {
                let p = c
                    .prepare_retrieve(id, &stored, None)
                    .map_err(|e| e.to_string())?
                    .ok_or("stored chunk missed")?;
                c.commit_retrieve(id, p.transfer_id)
                    .map_err(|e| e.to_string())?;
            }
            "lookup" => {
                c.lookup(&format!("r{i}"), &all_ranks, 1)
                    .map_err(|e| e.to_string())?;
            }
            other => return Err(format!("unknown op {other:?}; one of {OPS:?}")),
        }
    }
    c.unregister(id).map_err(|e| e.to_string())?;
    Ok(())
}
