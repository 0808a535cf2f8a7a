//! Redis Cluster's key space: which of the 16384 slots a key hashes to (CRC16-XMODEM of
//! the key, or of its `{hash tag}`, mod 16384), and the map of slots to the masters that
//! serve them, parsed from a `CLUSTER SLOTS` reply.

use redis::Value;

/// Slots in a Redis Cluster.
pub(super) const SLOTS: usize = 16384;

/// CRC16-XMODEM (polynomial 0x1021, initial value 0, no reflection), as Redis Cluster
/// hashes keys.
pub(super) fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of `key`: the part between the first `{` and the next `}` when that part is
/// not empty (a hash tag), else the whole key, hashed.
pub(super) fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS as u16
}

/// Which master serves each slot: `masters` holds their addresses (`host:port`), `slots`
/// an index into it per slot (`None`: no master known).
#[derive(Clone, Debug, Default)]
pub(super) struct SlotMap {
    /// The masters' addresses.
    pub masters: Vec<String>,
    /// Per slot, the index of its master in `masters`.
    pub slots: Vec<Option<u16>>,
}

impl SlotMap {
    /// The master serving `slot`, if known.
    pub fn master(&self, slot: u16) -> Option<&str> {
        let i = (*self.slots.get(usize::from(slot))?)?;
        self.masters.get(usize::from(i)).map(String::as_str)
    }

    /// Records that `addr` serves `slot` (a `MOVED` reply's news).
    pub fn set(&mut self, slot: u16, addr: &str) {
        if self.slots.len() != SLOTS {
            self.slots = vec![None; SLOTS];
        }
        let i = match self.masters.iter().position(|m| m == addr) {
            Some(i) => i,
            None => {
                self.masters.push(addr.to_string());
                self.masters.len() - 1
            }
        };
        if let Ok(i) = u16::try_from(i) {
            self.slots[usize::from(slot)] = Some(i);
        }
    }

    /// The map a `CLUSTER SLOTS` reply describes: `[[start, end, [host, port, id, ...],
    /// replicas...], ...]`. An empty host is `asked_host` (the node that replied); a
    /// range whose master has no known endpoint (`?`) stays unmapped. `None` for a reply
    /// of another shape or a range outside the slots.
    pub fn parse(reply: Value, asked_host: &str) -> Option<SlotMap> {
        let Value::Array(ranges) = reply else {
            return None;
        };
        let mut map = SlotMap {
            masters: Vec::new(),
            slots: vec![None; SLOTS],
        };
        for range in ranges {
            let Value::Array(parts) = range else {
                return None;
            };
            let mut parts = parts.into_iter();
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (parts.next(), parts.next(), parts.next())
            else {
                return None;
            };
            let (start, end) = (u16::try_from(start).ok()?, u16::try_from(end).ok()?);
            if start > end || usize::from(end) >= SLOTS {
                return None;
            }
            let mut node = master.into_iter();
            let host = match node.next()? {
                Value::BulkString(h) => String::from_utf8(h).ok()?,
                Value::SimpleString(h) => h,
                _ => return None,
            };
            let Some(Value::Int(port)) = node.next() else {
                return None;
            };
            let port = u16::try_from(port).ok()?;
            if host == "?" || port == 0 {
                continue;
            }
            let host = if host.is_empty() { asked_host } else { &host };
            let addr = join(host, port);
            for slot in start..=end {
                map.set(slot, &addr);
            }
        }
        Some(map)
    }
}

/// `host:port`, an IPv6 address in brackets.
pub(super) fn join(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The host and port of `host:port` (`[v6]:port` too).
pub(super) fn split(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host, port.parse().ok()?))
}

/// A redirection in a reply: `MOVED slot host:port` or `ASK slot host:port`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Redirect {
    /// The slot lives at the address now (update the map).
    Moved(u16, String),
    /// This one key is asked at the address, after `ASKING` (a slot being migrated).
    Ask(u16, String),
}

impl Redirect {
    /// The redirection an error reply holds, if it is one.
    pub fn of(reply: &Value) -> Option<Redirect> {
        let Value::ServerError(e) = reply else {
            return None;
        };
        let (slot, addr) = e.details()?.trim().split_once(' ')?;
        let slot: u16 = slot.parse().ok()?;
        if usize::from(slot) >= SLOTS || split(addr).is_none() {
            return None;
        }
        match e.code() {
            "MOVED" => Some(Redirect::Moved(slot, addr.to_string())),
            "ASK" => Some(Redirect::Ask(slot, addr.to_string())),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_the_cluster_spec() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16(b""), 0);
    }

    #[test]
    fn slots_follow_hash_tags() {
        // Values redis-cli's CLUSTER KEYSLOT gives.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // An empty tag, or none closed: the whole key.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"{abc"), crc16(b"{abc") % 16384);
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![bulk(host), Value::Int(port), bulk("id")])
    }

    #[test]
    fn cluster_slots_replies_parse_into_a_map() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(10922), node("", 7001)]),
            Value::Array(vec![Value::Int(10923), Value::Int(16383), node("?", 7002)]),
        ]);
        let map = SlotMap::parse(reply, "10.0.0.9").unwrap();
        assert_eq!(map.master(0), Some("127.0.0.1:7000"));
        assert_eq!(map.master(5460), Some("127.0.0.1:7000"));
        assert_eq!(map.master(5461), Some("10.0.0.9:7001"));
        assert_eq!(map.master(10922), Some("10.0.0.9:7001"));
        assert_eq!(map.master(10923), None);
        assert_eq!(map.masters.len(), 2);
        let mut map = map;
        map.set(10923, "127.0.0.1:7000");
        assert_eq!(map.master(10923), Some("127.0.0.1:7000"));
        assert_eq!(map.masters.len(), 2);
    }

    #[test]
    fn malformed_cluster_slots_replies_are_refused() {
        let bad = [
            Value::Int(1),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(10),
                Value::Int(5),
                node("h", 1),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(16384),
                node("h", 1),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(1),
                node("h", 70000),
            ])]),
        ];
        for b in bad {
            assert!(SlotMap::parse(b.clone(), "h").is_none(), "{b:?}");
        }
        assert!(SlotMap::parse(Value::Array(vec![]), "h").is_some());
    }

    fn reply(raw: &[u8]) -> Value {
        redis::Parser::new().parse_value(raw).unwrap()
    }

    #[test]
    fn redirections_are_read_from_error_replies() {
        assert_eq!(
            Redirect::of(&reply(b"-MOVED 3999 127.0.0.1:6381\r\n")),
            Some(Redirect::Moved(3999, "127.0.0.1:6381".into()))
        );
        assert_eq!(
            Redirect::of(&reply(b"-ASK 3999 [::1]:6381\r\n")),
            Some(Redirect::Ask(3999, "[::1]:6381".into()))
        );
        for other in [
            &b"-MOVED 16384 127.0.0.1:6381\r\n"[..],
            b"-MOVED x 127.0.0.1:6381\r\n",
            b"-MOVED 1 nowhere\r\n",
            b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
            b"-CLUSTERDOWN The cluster is down\r\n",
            b"$5\r\nMOVED\r\n",
        ] {
            assert_eq!(Redirect::of(&reply(other)), None);
        }
    }

    #[test]
    fn addresses_split_and_join() {
        assert_eq!(split("127.0.0.1:7000"), Some(("127.0.0.1", 7000)));
        assert_eq!(split("[::1]:7000"), Some(("::1", 7000)));
        assert_eq!(join("::1", 7000), "[::1]:7000");
        assert_eq!(split("nohost"), None);
    }
}
