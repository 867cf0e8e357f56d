//! Instance releases as the simulator sees them: releases the node made on its own (the reaper,
//! legitimate only past the liveness deadline), revival of reaped silent workers, the model's
//! side of a release, and the liveness stamps requests refresh.

use std::sync::Arc;

use super::{Check, Sim};
use crate::modules::instances::Instance;

impl Sim {
    /// Instances the node released on its own (the reaper): legitimate only once their
    /// deadline passed; a released instance holds nothing.
    pub(super) fn observe_releases(&mut self) -> Check {
        let now = self.now();
        let mut released: Vec<(u64, bool, u64)> = Vec::new();
        for a in &self.natives {
            if let Some(r) = &a.reg {
                if !self.is_live(&r.inst) {
                    released.push((a.id, true, r.deadline_ms()));
                }
            }
        }
        for a in &self.lms {
            if let Some(r) = &a.reg {
                if !self.is_live(&r.inst) {
                    // Its connection closed: the frontend may release it from the grace on.
                    let earliest = r
                        .closed_ms
                        .map_or(u64::MAX, |(c, p)| self.disconnect_window(c, p).0);
                    released.push((a.id, false, r.deadline_ms().min(earliest)));
                }
            }
        }
        let mut remote: Vec<(usize, u64)> = Vec::new();
        for (i, a) in self.remote.actors.iter().enumerate() {
            if let Some(r) = &a.reg {
                if !self.is_live(&r.inst) {
                    remote.push((i, r.deadline_ms()));
                }
            }
        }
        for (i, deadline) in remote {
            let id = self.remote.actors[i].id;
            if self.on("reaper") && now < deadline {
                return Err(format!(
                    "remote instance {id} was released at {now} ms, before its liveness deadline \
                     {deadline} ms, without UNREGISTER or disconnect"
                ));
            }
            self.stats.reaped += 1;
            self.log(format!("remote instance {id} reaped"));
            self.remote_forget(i)?;
            if self.remote.actors[i].dead {
                // A new process replaces the hung one: the old connection closes.
                self.remote_close(i, "the hung engine's connection closes")?;
                self.remote.actors[i].dead = false;
                self.stats.revived += 1;
            }
        }
        for (id, native, deadline) in released {
            if self.on("reaper") && now < deadline {
                return Err(format!(
                    "instance {id} was released at {now} ms, before its liveness deadline \
                     {deadline} ms, without UNREGISTER or disconnect"
                ));
            }
            self.stats.reaped += 1;
            self.log(format!("instance {id} reaped"));
            self.forget_instance(id, native)?;
            self.revive(id, native);
        }
        Ok(())
    }

    /// After its instance was reaped, a silent (hung) worker's process is replaced by a new one
    /// with the same id: the old connections close, the new process registers again.
    fn revive(&mut self, id: u64, native: bool) {
        if native {
            let a = self.natives.iter_mut().find(|a| a.id == id).expect("actor");
            if !a.dead {
                return;
            }
            let conns = a.revive();
            for c in conns {
                let registered = c.registered.lock().ids();
                self.ctx.connection_closed(c.id(), &registered, true);
            }
        } else {
            let a = self.lms.iter_mut().find(|a| a.id == id).expect("actor");
            a.revive();
        }
        self.stats.revived += 1;
        self.log(format!("worker {id} restarts as a new process"));
    }

    pub(super) fn is_live(&self, inst: &Arc<Instance>) -> bool {
        self.ctx
            .instances
            .get(inst.id)
            .is_some_and(|cur| Arc::ptr_eq(&cur, inst))
    }

    /// The model's side of a release: the instance object must be released and empty; the
    /// client's transfers are gone.
    pub(super) fn forget_instance(&mut self, id: u64, native: bool) -> Check {
        let reg = if native {
            let a = self.natives.iter_mut().find(|a| a.id == id).expect("actor");
            a.forget();
            a.reg.take()
        } else {
            let a = self.lms.iter_mut().find(|a| a.id == id).expect("actor");
            a.forget();
            a.reg.take()
        };
        self.model.release_instance(id);
        let Some(reg) = reg else { return Ok(()) };
        if !reg.inst.is_released() {
            return Err(format!(
                "instance {id} left the table but is not marked released"
            ));
        }
        let p = reg.inst.pending.lock();
        if !p.writes.is_empty() || !p.reads.is_empty() {
            return Err(format!(
                "released instance {id} still lists {} pending stores and {} pending retrieves",
                p.writes.len(),
                p.reads.len()
            ));
        }
        Ok(())
    }

    /// A request named instance `id`: the node refreshed its liveness stamp.
    pub(super) fn touched(&mut self, id: u64, ping: bool) {
        let now = self.now();
        let reg = self
            .natives
            .iter_mut()
            .filter_map(|a| a.reg.as_mut())
            .chain(self.lms.iter_mut().filter_map(|a| a.reg.as_mut()))
            .chain(self.remote.actors.iter_mut().filter_map(|a| a.reg.as_mut()))
            .find(|r| r.inst.id == id);
        if let Some(r) = reg {
            r.last_seen_ms = now;
            r.pinged |= ping;
        }
    }
}
