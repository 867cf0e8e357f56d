//! `kvnode gpu probe`: which GPUs this host's engines can use with kvnode, or why none.

use super::{CliError, EXIT_NO_GPU};

/// `kvnode gpu ...`.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum GpuCommand {
    /// List the GPUs the CUDA driver offers (name, memory, driver, dma-buf for GPUDirect RDMA),
    /// or say why there are none (no driver library, no device, driver too old, built without
    /// the `gpu` feature) and exit with status 4.
    Probe {
        /// Print a JSON object.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn gpu(cmd: GpuCommand) -> Result<(), CliError> {
    let GpuCommand::Probe { json } = cmd;
    match kvnode_hw::gpu::probe() {
        Ok(gpus) => {
            if json {
                let list: Vec<_> = gpus
                    .iter()
                    .map(|g| {
                        serde_json::json!({
                            "ordinal": g.ordinal,
                            "name": g.name,
                            "total_bytes": g.total_bytes,
                            "driver": kvnode_hw::gpu::driver_version_string(g.driver_version),
                            "dma_buf": g.dma_buf,
                        })
                    })
                    .collect();
                println!("{}", serde_json::json!({ "available": true, "gpus": list }));
            } else {
                for g in &gpus {
                    println!(
                        "GPU {}: {} ({} MiB, CUDA driver {}, dma-buf {})",
                        g.ordinal,
                        g.name,
                        g.total_bytes >> 20,
                        kvnode_hw::gpu::driver_version_string(g.driver_version),
                        if g.dma_buf { "yes" } else { "no" }
                    );
                }
            }
            Ok(())
        }
        Err(why) => {
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "available": false, "reason": why.to_string() })
                );
            }
            Err(CliError {
                message: format!("no GPU: {why}"),
                code: EXIT_NO_GPU,
            })
        }
    }
}
