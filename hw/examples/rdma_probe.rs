//! Prints this host's RDMA devices and what the node would use (device, port, GID), for
//! `scripts/rdma-selftest.sh`. Exit status: 0 when a device is usable, 2 when none is.
//!
//! Usage: `rdma_probe [DEVICE]` (`auto` by default).

use kvnode_hw::fabric::{rdma_availability, rdma_device_names};

fn main() {
    let device = std::env::args().nth(1).unwrap_or_else(|| "auto".into());
    match rdma_device_names() {
        Ok(names) => println!("devices: {}", names.join(", ")),
        Err(why) => println!("devices: none ({why})"),
    }
    match rdma_availability(&device) {
        Ok(desc) => println!("the node would use: {desc}"),
        Err(why) => {
            println!("unavailable: {why}");
            std::process::exit(2);
        }
    }
}
