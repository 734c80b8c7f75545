//! Maps of entries that expire, as the embedded store and the budget ledger keep them: an
//! expired entry reads as a missing one, so dropping it late changes no answer, and a sweep
//! gives back the room a burst left behind, so memory follows the live entries rather than the
//! most there ever were.

use std::collections::HashMap;
use std::hash::Hash;

/// Drops the entries of `map` that are not `alive`, and gives back the room of a map that holds
/// less than a quarter of what it has room for (a burst's leftovers).
pub fn sweep_map<K: Hash + Eq, V>(map: &mut HashMap<K, V>, mut alive: impl FnMut(&V) -> bool) {
    map.retain(|_, v| alive(v));
    if map.capacity() > 4 * map.len().max(256) {
        map.shrink_to(2 * map.len());
    }
}
