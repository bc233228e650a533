//! How deep a YAML text nests, as libyaml itself parses it, stopping at the limit.
//!
//! libyaml's scanner costs time proportional to the flow depth for every token, so a
//! text nested thousands deep costs time quadratic in its size before any value is
//! built (serde_yaml_ng parses a whole document into events before it deserializes).
//! A lexer of our own that guesses where scalars begin can be fooled (a `"` inside a
//! `|` block scalar hid the brackets after it); so the depth is counted on libyaml's
//! own events, pulled one at a time, and the pull stops at the first collection deeper
//! than the limit: the scanner never goes further than about a line past that point.
//! This is the one module of the crate that calls unsafe code: unsafe-libyaml (the
//! parser serde_yaml_ng runs on, so both see the same structure) has only a C-style API.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use unsafe_libyaml as unsafe_sys;

/// What the event pull found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Depth {
    /// Every collection of every document is at most the limit deep.
    Within,
    /// A collection deeper than the limit begins; the parse stopped there.
    Deeper,
    /// libyaml failed before either (a syntax error, which the real parse reports).
    Unparsed,
}

/// A parser initialised over `text`, deleted on drop.
struct Parser<'a> {
    sys: Box<MaybeUninit<unsafe_sys::yaml_parser_t>>,
    _text: &'a [u8],
}

impl<'a> Parser<'a> {
    fn new(text: &'a [u8]) -> Option<Parser<'a>> {
        let mut sys = Box::new(MaybeUninit::<unsafe_sys::yaml_parser_t>::uninit());
        // SAFETY: the parser is initialised in place before any other use (a failed
        // initialisation, out of memory, leaves nothing to delete); the input is
        // borrowed for the parser's whole life ('a), as set_input_string requires.
        unsafe {
            if unsafe_sys::yaml_parser_initialize(sys.as_mut_ptr()).fail {
                return None;
            }
            unsafe_sys::yaml_parser_set_encoding(sys.as_mut_ptr(), unsafe_sys::YAML_UTF8_ENCODING);
            unsafe_sys::yaml_parser_set_input_string(
                sys.as_mut_ptr(),
                text.as_ptr(),
                text.len() as u64,
            );
        }
        Some(Parser { sys, _text: text })
    }

    /// The next event's type; `None` on a parse error.
    fn next(&mut self) -> Option<unsafe_sys::yaml_event_type_t> {
        let mut event = MaybeUninit::<unsafe_sys::yaml_event_t>::uninit();
        // SAFETY: the parser was initialised; yaml_parser_parse fills the event when it
        // succeeds (and only then is it read and deleted, once).
        unsafe {
            if unsafe_sys::yaml_parser_parse(self.sys.as_mut_ptr(), event.as_mut_ptr()).fail {
                return None;
            }
            let kind = (*event.as_ptr()).type_;
            unsafe_sys::yaml_event_delete(event.as_mut_ptr());
            Some(kind)
        }
    }
}

impl Drop for Parser<'_> {
    fn drop(&mut self) {
        // SAFETY: initialised in `new` (a Parser exists only then), deleted once.
        unsafe { unsafe_sys::yaml_parser_delete(self.sys.as_mut_ptr()) }
    }
}

/// Whether `text` nests collections (flow or block, sequences or mappings) more than
/// `max` deep, in any of its documents.
pub(super) fn depth(text: &[u8], max: usize) -> Depth {
    let Some(mut parser) = Parser::new(text) else {
        return Depth::Unparsed;
    };
    let mut depth = 0usize;
    loop {
        match parser.next() {
            None => return Depth::Unparsed,
            Some(unsafe_sys::YAML_SEQUENCE_START_EVENT | unsafe_sys::YAML_MAPPING_START_EVENT) => {
                depth += 1;
                if depth > max {
                    return Depth::Deeper;
                }
            }
            Some(unsafe_sys::YAML_SEQUENCE_END_EVENT | unsafe_sys::YAML_MAPPING_END_EVENT) => {
                depth = depth.saturating_sub(1);
            }
            Some(unsafe_sys::YAML_STREAM_END_EVENT) => return Depth::Within,
            Some(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_is_counted_on_libyaml_s_own_events() {
        assert_eq!(depth(b"a: [[1]]", 3), Depth::Within);
        assert_eq!(depth(b"a: [[[1]]]", 3), Depth::Deeper);
        assert_eq!(depth(b"- - - - x", 3), Depth::Deeper);
        assert_eq!(depth(b"a:\n  b:\n    c: 1\n", 3), Depth::Within);
        assert_eq!(depth(b"a:\n  b:\n    c:\n      d: 1\n", 3), Depth::Deeper);
        // Brackets inside scalars are not collections, however they are quoted.
        assert_eq!(
            depth(b"a: \"[[[[[[\"\nb: '{{{{{'\nc: |\n  [[[[[[\n", 3),
            Depth::Within
        );
        // Several documents: each is checked.
        assert_eq!(depth(b"a: 1\n---\nb: [[[[1]]]]\n", 3), Depth::Deeper);
        assert_eq!(depth(b"a: [1\n", 3), Depth::Unparsed);
    }
}
