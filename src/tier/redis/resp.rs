//! Commands encoded in RESP (the Redis protocol) as the segments a vectored write sends:
//! the framing and the short arguments copied into one buffer, the long arguments (a
//! payload, or the parts a payload is made of, sent as one bulk string of their summed
//! length) borrowed where they lie, never joined into a copy of the pipeline.

use std::ops::Range;

/// Arguments at least this long are sent from where they lie; shorter ones are copied
/// beside the framing (one more segment costs more than copying a few hundred bytes).
const BORROW_FROM: usize = 4096;

/// One segment: a range of the encoder's buffer, or bytes borrowed from the caller.
#[derive(Debug)]
enum Span<'a> {
    Own(Range<usize>),
    Borrowed(&'a [u8]),
}

/// A pipeline of commands as segments ([`Segments::slices`]) whose concatenation is the
/// pipeline's RESP encoding.
#[derive(Debug, Default)]
pub(super) struct Segments<'a> {
    buf: Vec<u8>,
    spans: Vec<Span<'a>>,
}

impl<'a> Segments<'a> {
    /// An empty pipeline.
    pub(super) fn new() -> Self {
        Self::default()
    }

    /// Appends a command of `args`, each one bulk string made of its parts, in order
    /// (an argument of one part is an ordinary argument).
    pub(super) fn command(&mut self, args: &[&[&'a [u8]]]) {
        self.own_fmt(format_args!("*{}\r\n", args.len()));
        for parts in args {
            self.arg(parts);
        }
    }

    /// Appends a command of plain arguments (each one part).
    pub(super) fn simple(&mut self, args: &[&'a [u8]]) {
        self.own_fmt(format_args!("*{}\r\n", args.len()));
        for a in args {
            self.arg(&[a]);
        }
    }

    /// Appends one argument: a bulk string of its parts' summed length, then the parts.
    fn arg(&mut self, parts: &[&'a [u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.own_fmt(format_args!("${len}\r\n"));
        for p in parts {
            self.bytes(p);
        }
        self.own(b"\r\n");
    }

    /// The segments, in order: their concatenation is the pipeline's encoding.
    pub(super) fn slices(&self) -> Vec<&[u8]> {
        self.spans
            .iter()
            .map(|s| match s {
                Span::Own(r) => &self.buf[r.clone()],
                Span::Borrowed(b) => *b,
            })
            .collect()
    }

    /// Appends `b`: borrowed when it is long, else copied.
    fn bytes(&mut self, b: &'a [u8]) {
        if b.len() >= BORROW_FROM {
            self.spans.push(Span::Borrowed(b));
        } else {
            self.own(b);
        }
    }

    /// Copies `b` into the buffer, extending the last segment when it is the buffer's
    /// end.
    fn own(&mut self, b: &[u8]) {
        let start = self.buf.len();
        self.buf.extend_from_slice(b);
        self.extend_own(start);
    }

    /// Formats `args` into the buffer, as [`Segments::own`] copies.
    fn own_fmt(&mut self, args: std::fmt::Arguments<'_>) {
        use std::io::Write;
        let start = self.buf.len();
        self.buf.write_fmt(args).expect("writing to a Vec");
        self.extend_own(start);
    }

    /// Covers the buffer from `start` to its end with a segment: the last one if it
    /// ends at `start`, else a new one.
    fn extend_own(&mut self, start: usize) {
        let end = self.buf.len();
        match self.spans.last_mut() {
            Some(Span::Own(r)) if r.end == start => r.end = end,
            _ => self.spans.push(Span::Own(start..end)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_the_pipelines_encoding_with_long_arguments_borrowed() {
        let page: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let (head, mac) = (vec![1u8; 112], vec![2u8; 32]);
        let mut s = Segments::new();
        s.command(&[
            &[b"SET"],
            &[b"k1"],
            &[&head, &page, &mac],
            &[b"EX"],
            &[b"60"],
        ]);
        s.simple(&[b"GET", b"k2"]);
        s.simple(&[b"SET", b"k3", &page]);
        let joined = [&head[..], &page, &mac].concat();
        let want = redis::pipe()
            .cmd("SET")
            .arg("k1")
            .arg(&joined)
            .arg("EX")
            .arg(60)
            .cmd("GET")
            .arg("k2")
            .cmd("SET")
            .arg("k3")
            .arg(&page)
            .get_packed_pipeline();
        let slices = s.slices();
        assert_eq!(slices.concat(), want);
        // The page is sent from where it lies (twice), everything else copied into 3
        // segments around it.
        let borrowed: Vec<&&[u8]> = slices
            .iter()
            .filter(|p| std::ptr::eq(p.as_ptr(), page.as_ptr()))
            .collect();
        assert_eq!(borrowed.len(), 2);
        assert_eq!(slices.len(), 5);
        assert_eq!(Segments::new().slices().concat(), Vec::<u8>::new());
    }
}
