//! Writing pages: every piece of text from the store goes through [`Html::text`],
//! which escapes HTML and writes control characters and bidirectional overrides as
//! visible escapes (`\u{202e}`), as moorctl does for a terminal. Markup is only ever
//! `&'static str`, so nothing read at run time can become markup.

use std::fmt::Display;

use moor::api::Timestamp;

/// A page being written.
#[derive(Default)]
pub struct Html(String);

impl Html {
    /// Markup written by this program.
    pub fn raw(&mut self, markup: &'static str) -> &mut Self {
        self.0.push_str(markup);
        self
    }

    /// Text, escaped.
    pub fn text(&mut self, text: impl AsRef<str>) -> &mut Self {
        escape_into(&mut self.0, text.as_ref());
        self
    }

    /// Text of several lines (a stored object, an error), escaped line by line: its
    /// line breaks and tabs stay, every other control character shows.
    pub fn lines(&mut self, text: impl AsRef<str>) -> &mut Self {
        for (i, line) in text.as_ref().split('\n').enumerate() {
            if i > 0 {
                self.0.push('\n');
            }
            for (j, part) in line.split('\t').enumerate() {
                if j > 0 {
                    self.0.push('\t');
                }
                escape_into(&mut self.0, part);
            }
        }
        self
    }

    /// A value's text (numbers, ids), escaped.
    pub fn show(&mut self, value: impl Display) -> &mut Self {
        self.text(value.to_string())
    }

    /// A link to `href` showing `text`.
    pub fn link(&mut self, href: &Href, text: impl AsRef<str>) -> &mut Self {
        self.raw("<a href=\"")
            .text(&href.0)
            .raw("\">")
            .text(text)
            .raw("</a>")
    }

    /// A table's head.
    pub fn head(&mut self, columns: &[&'static str]) -> &mut Self {
        self.raw("<table><thead><tr>");
        for c in columns {
            self.raw("<th>").raw(c).raw("</th>");
        }
        self.raw("</tr></thead><tbody>")
    }

    /// A cell with text.
    pub fn cell(&mut self, text: impl AsRef<str>) -> &mut Self {
        self.raw("<td>").text(text).raw("</td>")
    }

    /// A cell with a link.
    pub fn cell_link(&mut self, href: &Href, text: impl AsRef<str>) -> &mut Self {
        self.raw("<td>").link(href, text).raw("</td>")
    }

    /// A cell with a phase, styled by its word.
    pub fn cell_phase(&mut self, phase: impl AsRef<str>) -> &mut Self {
        let phase = phase.as_ref();
        self.raw("<td><span class=\"phase ")
            .text(phase.to_ascii_lowercase())
            .raw("\">")
            .text(phase)
            .raw("</span></td>")
    }

    /// The `moorctl` command that shows the same thing.
    pub fn cli(&mut self, command: &str) -> &mut Self {
        self.raw("<p class=\"cli\">In a terminal: <code>")
            .text(command)
            .raw("</code></p>")
    }

    /// What was written.
    pub fn into_string(self) -> String {
        self.0
    }
}

/// Escapes `text` for HTML text and attribute values (quoted).
fn escape_into(out: &mut String, text: &str) {
    for c in moor::process::printable(text).chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
}

/// A link target within the console: path segments percent-encoded, query values too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Href(String);

impl Href {
    /// A path of fixed segments (`/volumes`).
    pub fn to(path: &'static str) -> Href {
        Href(path.to_string())
    }

    /// Adds a path segment (a name), encoded.
    pub fn seg(mut self, segment: impl AsRef<str>) -> Href {
        self.0.push('/');
        encode_into(&mut self.0, segment.as_ref());
        self
    }

    /// Adds a query parameter (skipped when `value` is empty).
    pub fn param(mut self, name: &'static str, value: &str) -> Href {
        if value.is_empty() {
            return self;
        }
        self.0.push(if self.0.contains('?') { '&' } else { '?' });
        self.0.push_str(name);
        self.0.push('=');
        encode_into(&mut self.0, value);
        self
    }

    /// The target, as text.
    #[cfg(test)]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `s` percent-encoded for a path segment or a query value.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    encode_into(&mut out, s);
    out
}

fn encode_into(out: &mut String, s: &str) {
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

/// Decodes a percent-encoded query component (`+` is a space); `None` when it is not
/// valid UTF-8 once decoded.
pub fn decode(s: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(s.len());
    let mut it = s.bytes();
    while let Some(b) = it.next() {
        match b {
            b'+' => bytes.push(b' '),
            b'%' => {
                let hex = [it.next()?, it.next()?];
                let hex = std::str::from_utf8(&hex).ok()?;
                bytes.push(u8::from_str_radix(hex, 16).ok()?);
            }
            b => bytes.push(b),
        }
    }
    String::from_utf8(bytes).ok()
}

/// A query string's parameters, decoded; undecodable ones are dropped.
pub fn query(q: Option<&str>) -> Vec<(String, String)> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Some((decode(k)?, decode(v)?))
        })
        .collect()
}

/// How long ago `t` was, shortly (`3m12s ago`); `-` when unknown.
pub fn ago(t: Option<Timestamp>) -> String {
    match t {
        Some(t) => format!("{} ago", short(t.elapsed())),
        None => "-".into(),
    }
}

/// How long until `t` (`in 4s`, or `due` once passed); `-` when there is none.
pub fn until(t: Option<Timestamp>) -> String {
    let Some(t) = t else { return "-".into() };
    match t.system().duration_since(std::time::SystemTime::now()) {
        Ok(d) => format!("in {}", short(d)),
        Err(_) => "due".into(),
    }
}

fn short(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

/// Bytes in binary units (`1.0 GiB`).
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_the_store_never_becomes_markup() {
        let mut h = Html::default();
        h.text("<script>alert('x')</script>\u{1b}[2J\u{202e}gnirts\"&");
        let s = h.into_string();
        assert_eq!(
            s,
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;\\u{1b}[2J\\u{202e}gnirts&quot;&amp;"
        );
        assert!(!s.contains('\u{202e}') && !s.contains('\u{1b}'));
        let mut h = Html::default();
        h.lines("a\n\tb\r<i>\u{2066}");
        assert_eq!(h.into_string(), "a\n\tb\\u{d}&lt;i&gt;\\u{2066}");
    }

    #[test]
    fn links_encode_what_they_carry() {
        let href = Href::to("/volumes")
            .seg("default")
            .seg("a\"><script>")
            .param("label", "app=db&x");
        assert_eq!(
            href.as_str(),
            "/volumes/default/a%22%3E%3Cscript%3E?label=app%3Ddb%26x"
        );
        let mut h = Html::default();
        h.link(&href, "x");
        assert!(!h.into_string().contains("<script>"));
        let q = query(Some("label=app%3Ddb%26x&name=a+b&bad=%ff&x"));
        assert_eq!(
            q,
            vec![
                ("label".into(), "app=db&x".into()),
                ("name".into(), "a b".into()),
                ("x".into(), String::new())
            ]
        );
    }

    #[test]
    fn sizes_and_times_read_shortly() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1 << 30), "1.0 GiB");
        assert_eq!(short(std::time::Duration::from_secs(192)), "3m12s");
        assert_eq!(until(None), "-");
    }
}
