//! The GPU bench's physical limits, measured in the same run: copies between device memory and
//! host memory registered with the driver, and the same from pageable memory, with the request
//! size and concurrency of the node workload (one stream per instance, one wait per request).

use std::sync::Barrier;
use std::time::{Duration, Instant};

use kvnode_hw::fabric::EngineBuffer;
use kvnode_hw::gpu::{CopyItem, Gpu, HostMemory};

/// Aggregate GB/s of the four raw copies.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawRates {
    pub registered_d2h: f64,
    pub registered_h2d: f64,
    pub pageable_d2h: f64,
    pub pageable_h2d: f64,
}

#[derive(Clone, Copy)]
enum Kind {
    D2h,
    H2d,
}

/// Runs `threads` streams, each copying `batch` chunks of `chunk` bytes per request for
/// `secs` per measurement, into registered and into pageable host memory.
pub fn measure(
    gpu: &Gpu,
    threads: usize,
    chunk: u64,
    batch: usize,
    secs: Duration,
) -> Result<RawRates, String> {
    let mut out = RawRates::default();
    for pinned in [true, false] {
        for kind in [Kind::D2h, Kind::H2d] {
            let rate = run(gpu, threads, chunk, batch, secs, pinned, kind)?;
            match (pinned, kind) {
                (true, Kind::D2h) => out.registered_d2h = rate,
                (true, Kind::H2d) => out.registered_h2d = rate,
                (false, Kind::D2h) => out.pageable_d2h = rate,
                (false, Kind::H2d) => out.pageable_h2d = rate,
            }
        }
    }
    Ok(out)
}

fn run(
    gpu: &Gpu,
    threads: usize,
    chunk: u64,
    batch: usize,
    secs: Duration,
    pinned: bool,
    kind: Kind,
) -> Result<f64, String> {
    let bytes = chunk * batch as u64;
    let barrier = Barrier::new(threads);
    let results: Vec<Result<(u64, Duration), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || -> Result<(u64, Duration), String> {
                    let e = |e: kvnode_hw::HwError| e.to_string();
                    let dev = gpu.alloc(bytes).map_err(e)?;
                    let mut stream = gpu.stream().map_err(e)?;
                    let mut host = EngineBuffer::new(bytes as usize).map_err(e)?;
                    host.as_mut_slice().fill(0x5a); // fault the pages in before timing
                    let mut host = if pinned {
                        Host::Pinned(gpu.pin(host).map_err(e)?)
                    } else {
                        Host::Plain(host)
                    };
                    let items: Vec<CopyItem> = dev
                        .chunks(chunk, batch)
                        .map_err(e)?
                        .into_iter()
                        .enumerate()
                        .map(|(i, device)| CopyItem {
                            host_offset: i as u64 * chunk,
                            device,
                        })
                        .collect();
                    let mut once = |stream: &mut kvnode_hw::gpu::GpuStream| -> Result<(), String> {
                        let host: &mut dyn HostMemory = match &mut host {
                            Host::Pinned(p) => p,
                            Host::Plain(b) => b,
                        };
                        match kind {
                            Kind::D2h => stream.device_to_host(host, &items),
                            Kind::H2d => stream.host_to_device(&*host, &items),
                        }
                        .map(drop)
                        .map_err(|e| e.to_string())
                    };
                    once(&mut stream)?; // warm-up
                    barrier.wait();
                    let t = Instant::now();
                    let mut moved = 0u64;
                    while t.elapsed() < secs {
                        once(&mut stream)?;
                        moved += bytes;
                    }
                    Ok((moved, t.elapsed()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a raw-copy thread panicked".into()))
            })
            .collect()
    });
    let mut moved = 0u64;
    let mut longest = Duration::ZERO;
    for r in results {
        let (m, d) = r?;
        moved += m;
        longest = longest.max(d);
    }
    Ok(moved as f64 / longest.as_secs_f64().max(1e-9) / 1e9)
}

/// The host side of one raw copy thread.
enum Host {
    Pinned(kvnode_hw::gpu::Pinned<EngineBuffer>),
    Plain(EngineBuffer),
}
