//! The shared GPU logic through the simulated device: bounds, spans of other handles,
//! merging, one wait per call (also after a failure), registration counted once per range.

use std::sync::Arc;

use super::*;
use crate::fabric::EngineBuffer;
use crate::{HwError, PoolMapping, PoolOptions, SharedPool};

const MIB: u64 = 1 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn copies_move_bytes_both_ways_with_one_wait_per_call() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, true);
    let dev = gpu.alloc(4 * MIB).unwrap();
    dev.write(0, &pattern(1, 4 * MIB as usize)).unwrap();
    let mut host = EngineBuffer::new(8 * MIB as usize).unwrap();
    let mut s = gpu.stream().unwrap();
    // Four 1 MiB chunks into four host places, two of them adjacent.
    let spans = dev.chunks(MIB, 4).unwrap();
    let offsets = [0, MIB, 3 * MIB, 6 * MIB];
    let items: Vec<CopyItem> = spans
        .iter()
        .zip(offsets)
        .map(|(&device, host_offset)| CopyItem {
            host_offset,
            device,
        })
        .collect();
    let r = s.device_to_host(&mut host, &items).unwrap();
    assert_eq!(
        (r.items, r.copies, r.bytes),
        (4, 3, 4 * MIB),
        "the first two merge"
    );
    assert_eq!(s.synchronizations(), 1);
    let want = pattern(1, 4 * MIB as usize);
    for (i, off) in offsets.iter().enumerate() {
        let got = &host.as_slice()[*off as usize..(*off + MIB) as usize];
        assert_eq!(got, &want[i * MIB as usize..(i + 1) * MIB as usize]);
    }
    // And back into a second buffer, reversed.
    let back = gpu.alloc(4 * MIB).unwrap();
    let bspans = back.chunks(MIB, 4).unwrap();
    let items: Vec<CopyItem> = bspans
        .iter()
        .rev()
        .zip(offsets)
        .map(|(&device, host_offset)| CopyItem {
            host_offset,
            device,
        })
        .collect();
    s.host_to_device(&host, &items).unwrap();
    assert_eq!(s.synchronizations(), 2);
    let mut out = vec![0u8; 4 * MIB as usize];
    back.read(0, &mut out).unwrap();
    for i in 0..4 {
        let j = 3 - i;
        assert_eq!(
            &out[i * MIB as usize..(i + 1) * MIB as usize],
            &want[j * MIB as usize..(j + 1) * MIB as usize]
        );
    }
    let c = ctl.counters();
    assert_eq!(c.synchronizations, 2);
    assert_eq!(c.pageable_copies, c.enqueued, "nothing was pinned");
}

#[test]
fn bad_items_are_refused_before_anything_is_enqueued() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, false);
    let (other, _) = Gpu::fake(64 * MIB, false);
    let dev = gpu.alloc(2 * MIB).unwrap();
    let foreign = other.alloc(MIB).unwrap();
    let mut host = EngineBuffer::new(2 * MIB as usize).unwrap();
    let mut s = gpu.stream().unwrap();
    let span = dev.span(0, MIB).unwrap();
    let past = [CopyItem {
        host_offset: MIB + 1,
        device: span,
    }];
    assert!(matches!(
        s.device_to_host(&mut host, &past),
        Err(HwError::OutOfBounds { .. })
    ));
    let f = [CopyItem {
        host_offset: 0,
        device: foreign.span(0, MIB).unwrap(),
    }];
    let e = s.device_to_host(&mut host, &f).unwrap_err().to_string();
    assert!(e.contains("another GPU handle"), "{e}");
    let twice = [
        CopyItem {
            host_offset: 0,
            device: span,
        },
        CopyItem {
            host_offset: MIB / 2,
            device: dev.span(MIB, MIB).unwrap(),
        },
    ];
    let e = s.device_to_host(&mut host, &twice).unwrap_err().to_string();
    assert!(e.contains("write the same bytes"), "{e}");
    // Host-to-device: two items writing one device range.
    let e = s
        .host_to_device(
            &host,
            &[
                CopyItem {
                    host_offset: 0,
                    device: span,
                },
                CopyItem {
                    host_offset: MIB,
                    device: span,
                },
            ],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("device addresses"), "{e}");
    assert!(dev.span(MIB, MIB + 1).is_err());
    assert!(dev.span(0, 0).is_err());
    assert_eq!(ctl.counters().enqueued, 0);
    assert_eq!(s.synchronizations(), 0);
}

#[test]
fn a_failed_enqueue_still_waits_for_the_copies_before_it() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, false);
    let dev = gpu.alloc(2 * MIB).unwrap();
    dev.write(0, &pattern(9, 2 * MIB as usize)).unwrap();
    let mut host = EngineBuffer::new(4 * MIB as usize).unwrap();
    let mut s = gpu.stream().unwrap();
    let items = [
        CopyItem {
            host_offset: 0,
            device: dev.span(0, MIB).unwrap(),
        },
        CopyItem {
            host_offset: 3 * MIB,
            device: dev.span(MIB, MIB).unwrap(),
        },
    ];
    ctl.fail_enqueue_after(2);
    let e = s.device_to_host(&mut host, &items).unwrap_err().to_string();
    assert!(e.contains("injected"), "{e}");
    assert_eq!(s.synchronizations(), 1, "waited although the call failed");
    assert_eq!(ctl.counters().synchronizations, 1);
    assert_eq!(
        &host.as_slice()[..MIB as usize],
        &pattern(9, 2 * MIB as usize)[..MIB as usize]
    );
    ctl.fail_next_sync();
    assert!(s.device_to_host(&mut host, &items).is_err());
    assert!(
        s.device_to_host(&mut host, &items).is_ok(),
        "one-shot fault"
    );
}

#[test]
fn raw_device_ranges_must_lie_in_one_allocation() {
    let (gpu, _) = Gpu::fake(64 * MIB, false);
    let dev = gpu.alloc(MIB).unwrap();
    // SAFETY: `dev` outlives the wrapper.
    let inner = unsafe { DeviceBuffer::from_raw(&gpu, dev.ptr() + 4096, 8192) }.unwrap();
    assert_eq!(inner.len(), 8192);
    drop(inner);
    // SAFETY: refused before use.
    let e = unsafe { DeviceBuffer::from_raw(&gpu, dev.ptr() + MIB - 10, 20) }.unwrap_err();
    assert!(e.to_string().contains("not inside one allocation"), "{e}");
    // SAFETY: refused before use.
    assert!(unsafe { DeviceBuffer::from_raw(&gpu, 12345, 10) }.is_err());
    // The wrapper does not free: the allocation is still readable.
    let mut b = [0u8; 4];
    dev.read(0, &mut b).unwrap();
}

#[test]
fn device_memory_is_bounded_and_freed() {
    let (gpu, ctl) = Gpu::fake(4 * MIB, false);
    let a = gpu.alloc(3 * MIB).unwrap();
    let e = gpu.alloc(2 * MIB).unwrap_err().to_string();
    assert!(e.contains("OUT_OF_MEMORY"), "{e}");
    assert!(gpu.alloc(0).is_err());
    drop(a);
    assert_eq!(ctl.device_bytes_in_use(), 0);
    gpu.alloc(4 * MIB).unwrap();
}

#[test]
fn one_registration_per_range_however_many_pin_it() {
    let pool = SharedPool::create(&PoolOptions {
        bytes: 8 * MIB,
        prefer: crate::PagePreference::Pages4K,
        ..PoolOptions::default()
    })
    .unwrap();
    let fd = pool.fd().try_clone_to_owned().unwrap();
    let mapping = Arc::new(PoolMapping::from_fd(fd, 8 * MIB).unwrap());
    let (gpu, ctl) = Gpu::fake(64 * MIB, false);
    let (gpu2, _) = (gpu.clone(), ());
    let p1 = gpu.pin(mapping.clone()).unwrap();
    let p2 = gpu2.pin(mapping.clone()).unwrap();
    assert_eq!(ctl.counters().registrations, 1);
    assert_eq!(gpu.registered_host_ranges(), 1);
    // Copies into the pinned pool count as registered.
    let dev = gpu.alloc(MIB).unwrap();
    let mut s = gpu.stream().unwrap();
    let mut target = p1;
    s.device_to_host(
        &mut target,
        &[CopyItem {
            host_offset: 0,
            device: dev.span(0, MIB).unwrap(),
        }],
    )
    .unwrap();
    assert_eq!(ctl.counters().registered_copies, 1);
    drop(target);
    assert_eq!(ctl.counters().unregistrations, 0, "p2 still holds it");
    drop(p2);
    assert_eq!(ctl.counters().unregistrations, 1);
    assert_eq!(ctl.registered_ranges(), 0);
    // A second, separate mapping of the same pool is a different range: its own registration.
    let fd = pool.fd().try_clone_to_owned().unwrap();
    let other = Arc::new(PoolMapping::from_fd(fd, 8 * MIB).unwrap());
    let a = gpu.pin(mapping.clone()).unwrap();
    let b = gpu.pin(other).unwrap();
    assert_eq!(ctl.registered_ranges(), 2);
    drop((a, b));
    assert_eq!(ctl.registered_ranges(), 0);
}

#[test]
fn overlapping_registrations_are_refused_and_failures_leave_nothing() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, false);
    let buf = EngineBuffer::new(MIB as usize).unwrap();
    ctl.fail_register(true);
    let e = gpu.pin(buf).unwrap_err().to_string();
    assert!(e.contains("cuMemHostRegister"), "{e}");
    assert_eq!(gpu.registered_host_ranges(), 0);
    ctl.fail_register(false);
    let buf = EngineBuffer::new(MIB as usize).unwrap();
    let p = gpu.pin(buf).unwrap();
    let buf = p.into_inner();
    assert_eq!(ctl.counters().unregistrations, 1);
    assert_eq!(buf.len(), MIB as usize);
}

#[test]
fn registry_refuses_partial_overlaps_with_both_ranges_named() {
    let (gpu, ctl) = Gpu::fake(MIB, false);
    let reg = registry::HostRegistry::default();
    let b = gpu.backend_arc();
    reg.acquire(&b, 0x10000, 0x4000).unwrap();
    reg.acquire(&b, 0x10000, 0x4000).unwrap();
    for (p, l) in [
        (0x12000, 0x4000),
        (0xf000, 0x2000),
        (0x10000, 0x2000),
        (0xc000, 0x10000),
    ] {
        let e = reg.acquire(&b, p, l).unwrap_err().to_string();
        assert!(
            e.contains("overlaps the registered range [0x10000, 0x14000)"),
            "{e}"
        );
    }
    reg.acquire(&b, 0x14000, 0x1000).unwrap();
    assert_eq!(ctl.counters().registrations, 2);
    reg.release(0x10000);
    reg.release(0x10000);
    reg.release(0x14000);
    assert_eq!(ctl.counters().unregistrations, 2);
    assert_eq!(reg.len(), 0);
}

#[test]
fn dmabuf_export_names_a_window_around_the_buffer() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, true);
    let dev = gpu.alloc(3 * MIB + 100).unwrap();
    let x = gpu.export_dmabuf(&dev).unwrap();
    assert_eq!((x.iova, x.len, x.offset), (dev.ptr(), dev.len(), 0));
    assert!(x.window_len >= dev.len());
    assert_eq!(ctl.counters().exports, 1);
    let (no, _) = Gpu::fake(64 * MIB, false);
    let d2 = no.alloc(MIB).unwrap();
    let e = no.export_dmabuf(&d2).unwrap_err().to_string();
    assert!(e.contains("dma-buf"), "{e}");
    assert!(gpu.export_dmabuf(&d2).is_err(), "another handle's buffer");
}

/// Without the feature or without libcuda (this machine), probing is a clear error, never a
/// panic, and opening a device says the same.
#[test]
fn probing_without_a_gpu_is_a_clear_error() {
    match probe() {
        Ok(gpus) => {
            eprintln!(
                "this host has {} GPU(s): the no-GPU path is not exercised",
                gpus.len()
            );
            assert!(!gpus.is_empty());
        }
        Err(why) => {
            let msg = why.to_string();
            #[cfg(not(feature = "gpu"))]
            assert_eq!(why, GpuUnavailable::NotBuilt, "{msg}");
            #[cfg(feature = "gpu")]
            assert_ne!(why, GpuUnavailable::NotBuilt, "{msg}");
            let e = Gpu::open(0).unwrap_err();
            assert!(
                matches!(e, HwError::GpuUnavailable(ref w) if *w == why),
                "{e}"
            );
        }
    }
    // An ordinal far past any host's count.
    if probe().is_ok() {
        let e = Gpu::open(4096).unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }
}

#[test]
fn a_wait_that_cannot_be_issued_poisons_the_stream() {
    let (gpu, ctl) = Gpu::fake(64 * MIB, false);
    let dev = gpu.alloc(MIB).unwrap();
    let mut host = EngineBuffer::new(MIB as usize).unwrap();
    let mut s = gpu.stream().unwrap();
    let items = [CopyItem {
        host_offset: 0,
        device: dev.span(0, MIB).unwrap(),
    }];
    ctl.fail_next_wait_issue();
    let e = s.device_to_host(&mut host, &items).unwrap_err().to_string();
    assert!(e.contains("may still be running"), "{e}");
    assert!(s.is_poisoned());
    let e = s.device_to_host(&mut host, &items).unwrap_err().to_string();
    assert!(e.contains("unusable"), "{e}");
    assert_eq!(
        ctl.counters().enqueued,
        1,
        "nothing enqueued after the poison"
    );
    // A wait that ran and failed does not poison.
    let mut s2 = gpu.stream().unwrap();
    ctl.fail_next_sync();
    assert!(s2.device_to_host(&mut host, &items).is_err());
    assert!(!s2.is_poisoned());
    assert!(s2.device_to_host(&mut host, &items).is_ok());
}
