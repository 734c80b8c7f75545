//! Where a config problem is, as every check reports it: a node's tree path or a field's name,
//! and a line and column in the file when the parser kept one. Shared by the tree's checks
//! (`compile.rs`) and the price table's (`priced.rs`), so that neither reaches into the other.

use std::path::Path;

use serde_saphyr::Spanned;

use super::ConfigError;

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
