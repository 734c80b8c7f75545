//! Where a config problem is, as every check reports it: a node's tree path or a field's name,
//! and a line and column in the file when the parser kept one; parser errors put in the same
//! terms. Shared by the domain's checks (`src/config/compile.rs`), the tree's
//! (`src/config/tree.rs`) and the price table's (`src/config/priced.rs`), so that none reaches
//! into another.

use std::path::Path;

use serde_saphyr::Spanned;

use super::raw::MAX_NODES;
use super::{locate, ConfigError};

/// A problem and, when it is more precise than its node's, its line and column.
pub(super) struct Located {
    pub(super) message: String,
    pub(super) position: Option<(usize, usize)>,
}

impl From<String> for Located {
    fn from(message: String) -> Self {
        Located { message, position: None }
    }
}

impl From<&str> for Located {
    fn from(message: &str) -> Self {
        message.to_owned().into()
    }
}

/// A problem outside the descriptor tree: where in the file, and what.
pub(super) struct Problem {
    at: String,
    position: Option<(usize, usize)>,
    message: String,
}

impl Problem {
    pub(super) fn new(
        at: impl Into<String>,
        position: Option<(usize, usize)>,
        message: impl Into<String>,
    ) -> Problem {
        Problem { at: at.into(), position, message: message.into() }
    }

    /// The problem as the error of `file`.
    pub(super) fn in_file(self, file: &Path) -> ConfigError {
        ConfigError::Invalid {
            file: file.to_owned(),
            position: self.position,
            at: self.at,
            message: self.message,
        }
    }
}

/// The line and column of a value (`None` for the parser's unknown location).
pub(super) fn position<T>(spanned: &Spanned<T>) -> Option<(usize, usize)> {
    let at = spanned.referenced;
    (at.line() > 0).then(|| (at.line() as usize, at.column() as usize))
}

/// A string value and its position.
pub(super) fn text(value: Option<Spanned<String>>) -> (Option<String>, Option<(usize, usize)>) {
    match value {
        Some(v) => {
            let at = position(&v);
            (Some(v.value), at)
        }
        None => (None, None),
    }
}

/// A parser error as a [`ConfigError`]: its position, the tree path of the descriptor at that
/// line (found from `text`, see [`locate`]) and its message alone, on one line (the parser's own
/// rendering repeats the position and quotes a snippet of `<input>`).
pub(super) fn syntax(file: &Path, text: &str, error: &serde_saphyr::Error) -> ConfigError {
    use serde_saphyr::budget::BudgetBreach;
    use serde_saphyr::MessageFormatter as _;
    // The parser's node budget (its guard against YAML bombs) is the one limit on a file's size:
    // say so in the config's own terms.
    if let serde_saphyr::Error::Budget { breach: BudgetBreach::Nodes { .. }, .. } = error.without_snippet() {
        return ConfigError::Invalid {
            file: file.to_owned(),
            position: None,
            at: String::new(),
            message: format!(
                "the file is larger than one domain file may be: more than {} YAML nodes (about {} rules of a few lines each)",
                MAX_NODES, MAX_NODES / 11
            ),
        };
    }
    let message = serde_saphyr::DefaultMessageFormatter.format_message(error.without_snippet());
    let message: String = message.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let position =
        error.location().filter(|at| at.line() > 0).map(|at| (at.line() as usize, at.column() as usize));
    let at = position.map(|(line, _)| locate::tree_path(text, line)).unwrap_or_default();
    // The field the line holds, as semantic errors name theirs, unless the message does already.
    let message = match position.and_then(|(line, _)| locate::field(text, line)) {
        Some(field) if !message.contains(field) => format!("{field}: {message}"),
        _ => message,
    };
    ConfigError::Invalid { file: file.to_owned(), position, at, message }
}
