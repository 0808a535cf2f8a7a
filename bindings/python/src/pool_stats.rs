//! `BlockPool.stats()` as a Python dict, built from a snapshot taken under the lock.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::tiers::TierSnapshot;
use kvrs::PoolStats;

/// The dict `stats()` returns: occupancy, prefix-cache counters, per-kind usage and,
/// with tiers, their counters (see the README's `pool.stats()` row).
pub fn stats_dict<'py>(
    py: Python<'py>,
    s: &PoolStats,
    tiers: Option<&TierSnapshot>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_blocks", s.num_blocks)?;
    d.set_item("free_blocks", s.free_blocks)?;
    d.set_item("used_blocks", s.used_blocks)?;
    d.set_item("block_size", s.block_size)?;
    d.set_item("bytes_total", s.bytes_total)?;
    d.set_item("bytes_used", s.bytes_used)?;
    d.set_item("tokens_stored", s.tokens_stored)?;
    d.set_item("fragmentation_tokens", s.fragmentation_tokens)?;
    d.set_item("utilization_ratio", s.utilization_ratio)?;
    d.set_item("num_sequences", s.num_sequences)?;
    d.set_item("cached_blocks", s.cached_blocks)?;
    d.set_item("evictable_blocks", s.evictable_blocks)?;
    d.set_item("prefix_queries", s.prefix.queries)?;
    d.set_item("prefix_query_tokens", s.prefix.query_tokens)?;
    d.set_item("prefix_hit_tokens", s.prefix.hit_tokens)?;
    let rate = if s.prefix.query_tokens == 0 {
        0.0
    } else {
        s.prefix.hit_tokens as f64 / s.prefix.query_tokens as f64
    };
    d.set_item("hit_rate", rate)?;
    d.set_item("evictions", s.prefix.evictions)?;
    let kinds = PyDict::new(py);
    for k in &s.by_kind {
        let e = PyDict::new(py);
        e.set_item("layers", k.layers)?;
        e.set_item("used_blocks", k.used_blocks)?;
        e.set_item("bytes_used", k.bytes_used)?;
        e.set_item("tokens_stored", k.tokens_stored)?;
        kinds.set_item(k.kind.name(), e)?;
    }
    d.set_item("by_layer_type", kinds)?;
    // Per layer, K and V together; None where nothing is counted (not fp8, or a device pool).
    d.set_item("fp8_saturated", s.fp8_saturated.clone())?;
    // Recurrent state slots (pools with state layers); bytes_total/bytes_used count them.
    if let Some(st) = &s.states {
        d.set_item("state_slots", st.slots)?;
        d.set_item("free_state_slots", st.free_slots)?;
        d.set_item("state_bytes", st.bytes_total())?;
        d.set_item("state_bytes_used", st.bytes_used())?;
        // Checkpoints (prefix caching of hybrid models): slots, use, counters.
        d.set_item("state_checkpoints", st.checkpoints)?;
        d.set_item("state_checkpoints_used", st.checkpoints_used)?;
        d.set_item("state_checkpoints_cached", st.checkpoints_cached)?;
        d.set_item("checkpoints_taken", st.counters.taken)?;
        d.set_item("checkpoints_skipped", st.counters.skipped)?;
        d.set_item("checkpoint_hits", st.counters.hits)?;
        d.set_item("checkpoint_evictions", st.counters.evictions)?;
    }
    if let Some(t) = tiers {
        super::tiers::tier_stats(py, t, &d)?;
    }
    Ok(d)
}
