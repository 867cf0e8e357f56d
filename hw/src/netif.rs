//! The addresses of a network interface, by name (`getifaddrs`): libzmq as kvnode builds it
//! cannot bind an interface name, so kvnode binds the interface's address instead.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The IP addresses of the network interface `name` of this machine: IPv4 ones first, then
/// IPv6 ones other than link-local (those need a scope to bind). Empty when there is no such
/// interface, it has no address, or the interfaces cannot be listed.
pub fn interface_addresses(name: &str) -> Vec<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes the head of a list it allocates into `head` on success; the
    // list is freed below, once.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_name.is_null() || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        if unsafe { CStr::from_ptr(ifa.ifa_name) }.to_bytes() != name.as_bytes() {
            continue;
        }
        // SAFETY: ifa_addr points to a socket address whose family field says its real type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        match family {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if ip.segments()[0] & 0xffc0 != 0xfe80 {
                    out.push(IpAddr::V6(ip));
                }
            }
            _ => {}
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    out.sort_by_key(IpAddr::is_ipv6);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_interface_has_its_address_and_unknown_names_none() {
        let lo = interface_addresses("lo");
        assert_eq!(lo.first(), Some(&IpAddr::V4(Ipv4Addr::LOCALHOST)), "{lo:?}");
        assert!(interface_addresses("kvnode-no-such-if").is_empty());
        assert!(interface_addresses("").is_empty());
    }
}
