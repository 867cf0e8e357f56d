//! Runs the instances of a load test: as threads of this process, or as child processes
//! (`--processes`), all released together from a start barrier.

use std::io::IsTerminal;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::report;
use crate::workload::{Instance, InstanceResult, InstanceSpec};
use crate::Args;

/// Runs every instance on its own thread; returns their results in order.
pub fn run_threads(specs: &[InstanceSpec], args: &Args) -> Result<Vec<InstanceResult>, String> {
    let done = Arc::new(AtomicU64::new(0));
    let total = args.ops.map(|o| o * specs.len() as u64);
    let bar = if std::io::stderr().is_terminal() {
        let b = match total {
            Some(t) => indicatif::ProgressBar::new(t),
            None => indicatif::ProgressBar::new_spinner(),
        };
        Some(b)
    } else {
        None
    };
    let barrier = Arc::new(std::sync::Barrier::new(specs.len()));
    let handles: Vec<_> = specs
        .iter()
        .cloned()
        .map(|spec| {
            let done = done.clone();
            let barrier = barrier.clone();
            std::thread::Builder::new()
                .name(format!("bench-instance-{}", spec.index))
                .spawn(move || {
                    // A failed connect must still reach the barrier, or the others wait forever.
                    let inst = Instance::connect(spec);
                    match inst {
                        Ok(i) => i.run(
                            || {
                                barrier.wait();
                            },
                            |_| {
                                done.fetch_add(1, Ordering::Relaxed);
                            },
                        ),
                        Err(e) => {
                            barrier.wait();
                            Err(e)
                        }
                    }
                })
                .map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    while handles.iter().any(|h| !h.is_finished()) {
        if let Some(b) = &bar {
            b.set_position(done.load(Ordering::Relaxed));
            b.set_message(format!("{} ops", done.load(Ordering::Relaxed)));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| "instance thread panicked".to_string())?
        })
        .collect()
}

/// Runs every instance in its own child process (`__instance`); returns their results in order.
pub fn run_processes(specs: &[InstanceSpec]) -> Result<Vec<InstanceResult>, String> {
    use std::io::{BufRead, BufReader, Read, Write};
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = specs
        .iter()
        .map(|s| {
            Command::new(&exe)
                .arg("__instance")
                .arg(serde_json::to_string(s).map_err(|e| e.to_string())?)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("spawning instance process: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    // Start barrier: wait until every child has filled and warmed up, then release them together.
    let mut readers = Vec::new();
    for c in &mut children {
        let mut r = BufReader::new(c.stdout.take().ok_or("no child stdout")?);
        let mut line = String::new();
        while !line.starts_with("READY") {
            line.clear();
            if r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
                break; // the child failed before the barrier; its exit status says why
            }
        }
        readers.push(r);
    }
    for c in &mut children {
        if let Some(mut stdin) = c.stdin.take() {
            let _ = stdin.write_all(b"GO\n");
        }
    }
    children
        .into_iter()
        .zip(readers)
        .map(|(mut c, mut r)| {
            let mut out = String::new();
            r.read_to_string(&mut out).map_err(|e| e.to_string())?;
            let status = c.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                return Err(format!("instance process failed ({status})"));
            }
            report::instance_from_json(&out)
        })
        .collect()
}
