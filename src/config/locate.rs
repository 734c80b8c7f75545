//! Where in the descriptor tree a line of a domain file is, for the parser's own errors.
//!
//! Semantic errors carry the tree path of their node (`descriptors[0](tenant).descriptors[1](class=export)`)
//! because compilation walks the tree. The parser's errors (unknown keys, bad types, YAML
//! syntax) come with a line and column only; this finds the same path from the text, for files
//! written in block style (lists of `- key: ...` items under `descriptors:`, as every example
//! and envoyproxy/ratelimit's own files are). Where the structure is not that (flow-style lists,
//! anchors), it finds nothing, and the error has no path rather than a wrong one.

/// The tree path of the descriptor node holding line `line` (1-based) of `text`; empty if the
/// line is not inside a block-style descriptor item.
pub(super) fn tree_path(text: &str, line: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut segments = Vec::new();
    let mut at = match line.checked_sub(1) {
        Some(i) if i < lines.len() => i,
        _ => return String::new(),
    };
    // The column a node must start left of to contain the current line.
    let mut within = column(lines[at]).map_or(usize::MAX, |c| c + 1);
    while let Some((item, dash)) = enclosing_item(&lines, at, within) {
        let Some(parent) = parent_key(&lines, item, dash) else { break };
        if key_of(lines[parent]) != Some("descriptors") {
            break;
        }
        let index = (parent + 1..item).filter(|&i| is_item_at(lines[i], dash)).count();
        let (key, value) = item_key_value(&lines, item, dash);
        let Some(key) = key else { return String::new() };
        segments.push(match value {
            Some(v) if !v.is_empty() => format!("descriptors[{index}]({key}={v})"),
            _ => format!("descriptors[{index}]({key})"),
        });
        at = parent;
        within = column(lines[parent]).map_or(0, |c| c + 1);
    }
    segments.reverse();
    segments.join(".")
}

/// The key of the `key: value` entry on line `line` (1-based) of `text`, if the line holds one:
/// the field a parser error on that line is about.
pub(super) fn field(text: &str, line: usize) -> Option<&str> {
    key_of(text.lines().nth(line.checked_sub(1)?)?).filter(|k| !k.is_empty())
}

// The column of a line's first character, `None` for blank lines and comments.
fn column(line: &str) -> Option<usize> {
    let trimmed = line.trim_start();
    (!trimmed.is_empty() && !trimmed.starts_with('#')).then(|| line.len() - trimmed.len())
}

// Whether `line` is a list item whose dash is at `dash`.
fn is_item_at(line: &str, dash: usize) -> bool {
    column(line) == Some(dash) && (line[dash..].starts_with("- ") || line[dash..].trim_end() == "-")
}

// The nearest list item at or above `at` whose dash is left of `within`: (its line, dash column).
fn enclosing_item(lines: &[&str], at: usize, within: usize) -> Option<(usize, usize)> {
    let mut within = within;
    for i in (0..=at).rev() {
        let Some(c) = column(lines[i]) else { continue };
        if c >= within {
            continue;
        }
        if is_item_at(lines[i], c) {
            return Some((i, c));
        }
        // A mapping key further left closes the search: the line is not in a list item below it.
        within = c;
        if c == 0 {
            return None;
        }
    }
    None
}

// The `key:` line that holds the list whose item starts at `item` (dash at `dash`): the nearest
// line above at a column left of the dash, or at the dash's column (a list not indented).
fn parent_key(lines: &[&str], item: usize, dash: usize) -> Option<usize> {
    (0..item).rev().find(|&i| match column(lines[i]) {
        Some(c) if c < dash => true,
        Some(c) if c == dash => !is_item_at(lines[i], dash),
        _ => false,
    })
}

// The key of a `key: value` or `key:` line (without a leading dash).
fn key_of(line: &str) -> Option<&str> {
    let t = line.trim_start().trim_start_matches("- ").trim_start();
    let (key, _) = t.split_once(':')?;
    Some(unquote(key.trim()))
}

// The `key` and `value` entries of the item starting at `item`.
fn item_key_value<'a>(lines: &[&'a str], item: usize, dash: usize) -> (Option<&'a str>, Option<&'a str>) {
    let after_dash = &lines[item][dash + 1..];
    // The column of the item's entries: where the first one starts, on the dash line or below.
    let mut entries =
        (!after_dash.trim().is_empty()).then(|| dash + 1 + after_dash.len() - after_dash.trim_start().len());
    let (mut key, mut value) = (None, None);
    for (n, line) in lines[item..].iter().enumerate() {
        let Some(c) = column(line) else { continue };
        if n > 0 && c <= dash {
            break;
        }
        let entry = if n == 0 { after_dash.trim_start() } else { line.trim_start() };
        if entry.is_empty() {
            continue;
        }
        let first = *entries.get_or_insert(c);
        if n > 0 && c != first {
            continue;
        }
        if let Some((k, v)) = entry.split_once(':') {
            let v = unquote(v.split(" #").next().unwrap_or("").trim());
            match unquote(k.trim()) {
                "key" => key = Some(v),
                "value" => value = Some(v),
                _ => {}
            }
        }
    }
    (key, value)
}

fn unquote(s: &str) -> &str {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .or_else(|| s.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')))
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::tree_path;

    const FILE: &str = "domain: d\ndescriptors:\n  - key: a\n    bogus: 1\n  - key: tenant\n    descriptors:\n      # a comment\n      - key: class\n        value: \"export\"\n        rate_limit: {unit: minute, requests_per_unit: 1, bogus: 2}\n      - key: route\n        rate_limit:\n          unit: second\n          bogus: 3\ntiers: {}\n";

    #[test]
    fn finds_the_node_of_a_line() {
        assert_eq!(tree_path(FILE, 1), "");
        assert_eq!(tree_path(FILE, 3), "descriptors[0](a)");
        assert_eq!(tree_path(FILE, 4), "descriptors[0](a)");
        assert_eq!(tree_path(FILE, 6), "descriptors[1](tenant)");
        assert_eq!(tree_path(FILE, 10), "descriptors[1](tenant).descriptors[0](class=export)");
        assert_eq!(tree_path(FILE, 14), "descriptors[1](tenant).descriptors[1](route)");
        assert_eq!(tree_path(FILE, 15), "");
        assert_eq!(tree_path(FILE, 99), "");
    }

    #[test]
    fn unindented_lists_and_flow_style() {
        assert_eq!(
            tree_path("descriptors:\n- key: a\n  bogus: 1\n- key: b\n  value: x\n  bogus: 1\n", 6),
            "descriptors[1](b=x)"
        );
        assert_eq!(
            tree_path("descriptors: [{key: a, bogus: 1}]\n", 1),
            "",
            "flow style: no path rather than a wrong one"
        );
    }

    #[test]
    fn odd_text_never_panics() {
        let texts = [
            "",
            "-",
            "- ",
            "-\n  key: a\n",
            "\u{3000}- key: é\n\u{3000}\u{3000}x: 1",
            "descriptors:\r\n  - key: a\r\n    bogus: 1\r\n",
            "\t- key: a\n\tbogus",
            "descriptors:\n  -\n    key: a\n    value: b\n    bogus: 1\n",
        ];
        for text in texts {
            for line in 0..=text.lines().count() + 1 {
                let _ = tree_path(text, line);
            }
        }
        assert_eq!(
            tree_path(texts[7], 5),
            "descriptors[0](a=b)",
            "an item whose entries start below its dash"
        );
    }
}
