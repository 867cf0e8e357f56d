//! A strict parser of the Prometheus text exposition format (0.0.4) and a minimal HTTP client,
//! for the metrics tests. Strict: every line is a `# HELP`, a `# TYPE` or a sample of a family
//! declared before it; names, label sets, escapes and values follow the format's grammar; no
//! series appears twice; a histogram's buckets never decrease and its `+Inf` bucket equals its
//! `_count`. Anything else is an error naming the line.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A series' labels, sorted.
type Labels = Vec<(String, String)>;

/// One parsed exposition: sample values by series (`name` plus its sorted labels).
#[derive(Debug)]
pub struct Exposition {
    samples: BTreeMap<(String, Labels), f64>,
    types: HashMap<String, String>,
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    chars.next().is_some_and(ok_first) && chars.all(|c| ok_first(c) || c.is_ascii_digit())
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Parses `{a="x",b="y"}` at the start of `s`; returns the labels and the rest.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    let mut rest = s.strip_prefix('{').ok_or("expected {")?;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let eq = rest.find('=').ok_or("label without =")?;
        let name = &rest[..eq];
        if !is_name(name, false) {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    'n' => value.push('\n'),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((name.to_owned(), value));
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.starts_with('}') {
            return Err("expected , or } after a label".into());
        }
    }
}

impl Exposition {
    /// Parses `text` strictly (see the module docs).
    pub fn parse(text: &str) -> Result<Exposition, String> {
        let mut samples = BTreeMap::new();
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helps = std::collections::HashSet::new();
        for (n, line) in text.lines().enumerate() {
            let err = |e: String| format!("line {}: {e}: {line:?}", n + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(c) = line.strip_prefix("# ") {
                let mut parts = c.splitn(3, ' ');
                let (kw, name) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let rest = parts.next().unwrap_or("");
                // Only HELP and TYPE are checked; other comments are allowed.
                let bad = match kw {
                    "HELP" => !is_name(name, true) || !helps.insert(name.to_owned()),
                    "TYPE" => {
                        !is_name(name, true)
                            || !["counter", "gauge", "histogram", "summary", "untyped"]
                                .contains(&rest)
                            || types.insert(name.to_owned(), rest.to_owned()).is_some()
                    }
                    _ => false,
                };
                if bad {
                    return Err(err(format!("bad or repeated {kw}")));
                }
                continue;
            }
            let name_end = line
                .find(['{', ' '])
                .ok_or_else(|| err("no value".into()))?;
            let name = &line[..name_end];
            if !is_name(name, true) {
                return Err(err(format!("bad metric name {name:?}")));
            }
            let (mut labels, rest) = if line[name_end..].starts_with('{') {
                parse_labels(&line[name_end..]).map_err(err)?
            } else {
                (Vec::new(), &line[name_end..])
            };
            let mut fields = rest
                .strip_prefix(' ')
                .ok_or_else(|| err("no space before the value".into()))?
                .split(' ');
            let value = fields
                .next()
                .and_then(parse_value)
                .ok_or_else(|| err("bad value".into()))?;
            if let Some(ts) = fields.next() {
                ts.parse::<i64>().map_err(|_| err("bad timestamp".into()))?;
            }
            if fields.next().is_some() {
                return Err(err("trailing fields".into()));
            }
            let family = [
                name,
                name.trim_end_matches("_bucket"),
                name.trim_end_matches("_sum"),
            ]
            .into_iter()
            .chain([name.trim_end_matches("_count")])
            .find(|f| types.contains_key(*f))
            .ok_or_else(|| err("sample of no declared family".into()))?;
            if family != name && types[family] != "histogram" && types[family] != "summary" {
                return Err(err("suffix on a family that is no histogram".into()));
            }
            labels.sort();
            if samples.insert((name.to_owned(), labels), value).is_some() {
                return Err(err("repeated series".into()));
            }
        }
        let e = Exposition { samples, types };
        e.check_histograms()?;
        Ok(e)
    }

    fn check_histograms(&self) -> Result<(), String> {
        for (family, _) in self.types.iter().filter(|(_, t)| *t == "histogram") {
            let bucket = format!("{family}_bucket");
            // Label set without `le` -> (le, count) in order of le.
            let mut sets: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
            for ((name, labels), v) in &self.samples {
                if *name != bucket {
                    continue;
                }
                let le = labels
                    .iter()
                    .find(|(k, _)| k == "le")
                    .and_then(|(_, v)| parse_value(v))
                    .ok_or_else(|| format!("{bucket} without a numeric le"))?;
                let rest: Vec<_> = labels.iter().filter(|(k, _)| k != "le").cloned().collect();
                sets.entry(rest).or_default().push((le, *v));
            }
            for (labels, mut buckets) in sets {
                buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
                    return Err(format!("{family}{labels:?}: buckets decrease: {buckets:?}"));
                }
                let inf = buckets.last().filter(|b| b.0 == f64::INFINITY);
                let count = self
                    .samples
                    .get(&(format!("{family}_count"), labels.clone()));
                if inf.map(|b| b.1) != count.copied() || count.is_none() {
                    return Err(format!(
                        "{family}{labels:?}: +Inf bucket {inf:?} != count {count:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The value of series `name{labels}` (labels in any order), if present.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut l: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        l.sort();
        self.samples.get(&(name.to_owned(), l)).copied()
    }

    /// Like [`Exposition::get`], panicking with the exposition when absent.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels)
            .unwrap_or_else(|| panic!("no series {name}{labels:?} in the exposition"))
    }

    /// The declared type of family `name`.
    pub fn type_of(&self, name: &str) -> Option<&str> {
        self.types.get(name).map(String::as_str)
    }

    /// Whether any series of a name starting with `prefix` is present.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.samples.keys().any(|(n, _)| n.starts_with(prefix))
    }
}

/// One HTTP/1.1 exchange: `(status code, body)`. Errors (refused, reset, timeout) as they are.
pub fn http(addr: SocketAddr, request: &[u8]) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(30))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    s.set_write_timeout(Some(Duration::from_secs(60)))?;
    s.write_all(request)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8(raw).map_err(|_| std::io::ErrorKind::InvalidData)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or(std::io::ErrorKind::InvalidData)?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or(std::io::ErrorKind::InvalidData)?;
    let len: Option<usize> = head.lines().find_map(|l| {
        l.strip_prefix("Content-Length: ")
            .and_then(|v| v.trim().parse().ok())
    });
    if len.is_some_and(|n| n != body.len()) && !request.starts_with(b"HEAD") {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok((code, body.to_owned()))
}

/// `GET /metrics`, parsed; panics on anything but a 200 with a valid exposition.
pub fn scrape(addr: SocketAddr) -> Exposition {
    let (code, body) = http(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n")
        .unwrap_or_else(|e| panic!("scraping {addr}: {e}"));
    assert_eq!(code, 200, "{body}");
    Exposition::parse(&body).unwrap_or_else(|e| panic!("invalid exposition: {e}\n{body}"))
}
