//! `kvrs.PageStore`: an inference engine's own KV pages in kvrs tiers, sealed and
//! verified (the core is `kvrs::tier::PageStore`). Pages are read from and written to
//! the caller's buffers in place, in one batched call per tier, without the GIL.

use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::ToPython;
use super::page_bytes::{read_page, PageBytes};
use super::tiers::{parse_tiers, secret};
use kvrs::tier::PageStore;
use kvrs::WritePolicy;

/// Engine-owned KV pages (opaque bytes in the engine's page layout) stored in kvrs tiers
/// (`HostTier`, `DiskTier`, `RedisTier`; fastest first), each sealed in a kvrs payload
/// whose header and keyed MAC bind it to the store's `fingerprint` (the engine's facts:
/// model, KV dtype, layout, page bytes, TP/PP ranks, ...), its namespace (a tenant) and
/// its key, under the secret `tier_key`. A lookup copies a page into the caller's buffer
/// only after every check passed; anything else (a torn, truncated, corrupted or forged
/// payload, another model's, dtype's or tenant's page) is a miss.
#[pyclass(name = "PageStore", module = "kvrs", frozen)]
pub struct PyPageStore {
    store: Arc<PageStore>,
    facts: Vec<(String, String)>,
}

/// A fingerprint value as text: str, int, float or bool only (their text is stable).
fn fact(name: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if v.is_instance_of::<PyString>() {
        return v.extract();
    }
    if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyInt>() || v.is_instance_of::<PyFloat>()
    {
        return Ok(v.str()?.to_string());
    }
    Err(PyTypeError::new_err(format!(
        "fingerprint[{name:?}] must be a str, int, float or bool, not {}",
        v.get_type().name()?
    )))
}

/// `keys` as a list of str.
fn keys_arg(keys: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if keys.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "keys must be a list of str, not one str",
        ));
    }
    keys.try_iter()
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "keys must be a list of str, not {}",
                keys.get_type().name().map_or("?".into(), |n| n.to_string())
            ))
        })?
        .enumerate()
        .map(|(i, k)| {
            let k = k?;
            k.extract::<String>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "keys[{i}] must be a str, not {}",
                    k.get_type().name().map_or("?".into(), |n| n.to_string())
                ))
            })
        })
        .collect()
}

/// The items of argument `name` (a list of `what`), exactly one per key.
fn per_key<'py>(
    items: &Bound<'py, PyAny>,
    name: &'static str,
    what: &str,
    count: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let list: Vec<Bound<'py, PyAny>> = items
        .try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a list of {what}")))?
        .collect::<PyResult<_>>()?;
    if list.len() != count {
        return Err(PyValueError::new_err(format!(
            "{name} has {} items for {count} keys: give one per key",
            list.len()
        )));
    }
    Ok(list)
}

/// The pages of argument `pages`, one readable buffer per key.
fn pages_arg<'py>(pages: &Bound<'py, PyAny>, count: usize) -> PyResult<Vec<PageBytes<'py>>> {
    per_key(pages, "pages", "buffers", count)?
        .iter()
        .enumerate()
        .map(|(i, o)| read_page(o, "pages", i, false))
        .collect()
}

/// Two segments of `bufs` that share memory, as (the later key's index, the earlier
/// key's index; equal for two segments of one key), or None: the segments sorted by
/// address, each compared with the one reaching furthest before it (O(n log n)).
fn first_overlap(bufs: &[Vec<PageBytes<'_>>]) -> Option<(usize, usize)> {
    let mut spans: Vec<(std::ops::Range<usize>, usize)> = bufs
        .iter()
        .enumerate()
        .flat_map(|(i, segs)| segs.iter().map(move |b| (b.span(), i)))
        .filter(|(span, _)| !span.is_empty())
        .collect();
    spans.sort_unstable_by_key(|(span, _)| span.start);
    let mut furthest: Option<(usize, usize)> = None; // (end, key)
    for (span, key) in spans {
        if let Some((end, other)) = furthest {
            if span.start < end {
                return Some((key.max(other), key.min(other)));
            }
        }
        if furthest.is_none_or(|(end, _)| span.end > end) {
            furthest = Some((span.end, key));
        }
    }
    None
}

/// Each key's destination in `buffers`: one writable buffer, or a list or tuple of them
/// (the page's segments, in order; at least one).
fn segments_arg<'py>(
    buffers: &Bound<'py, PyAny>,
    count: usize,
) -> PyResult<Vec<Vec<PageBytes<'py>>>> {
    let list = per_key(
        buffers,
        "buffers",
        "buffers (or of lists of segments)",
        count,
    )?;
    list.iter()
        .enumerate()
        .map(|(i, o)| {
            if o.is_instance_of::<PyList>() || o.is_instance_of::<PyTuple>() {
                let segs: Vec<PageBytes<'py>> = o
                    .try_iter()?
                    .map(|s| read_page(&s?, "buffers", i, true))
                    .collect::<PyResult<_>>()?;
                if segs.is_empty() {
                    return Err(PyValueError::new_err(format!(
                        "buffers[{i}] is an empty list of segments: give at least one"
                    )));
                }
                Ok(segs)
            } else {
                Ok(vec![read_page(o, "buffers", i, true)?])
            }
        })
        .collect()
}

#[pymethods]
impl PyPageStore {
    #[new]
    #[pyo3(signature = (tiers, *, fingerprint, tier_key = None, write = "all"))]
    fn new(
        tiers: &Bound<'_, PyList>,
        fingerprint: &Bound<'_, PyAny>,
        tier_key: Option<&Bound<'_, PyAny>>,
        write: &str,
    ) -> PyResult<Self> {
        let tiers = parse_tiers(Some(tiers))?;
        let dict = fingerprint.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(format!(
                "fingerprint must be a dict of the engine's facts, not {}",
                fingerprint
                    .get_type()
                    .name()
                    .map_or("?".into(), |n| n.to_string())
            ))
        })?;
        let mut facts = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            let k: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("fingerprint's keys must be str"))?;
            let v = fact(&k, &v)?;
            facts.push((k, v));
        }
        let secret = tier_key.map(secret).transpose()?;
        let policy: WritePolicy = write.parse().map_err(|_| {
            PyValueError::new_err(format!(
                "write={write:?}: must be 'all' (every tier) or 'first' (the first tier that takes a page)"
            ))
        })?;
        let store = PageStore::new(tiers, secret.as_deref(), &facts, policy).py()?;
        Ok(PyPageStore {
            store: Arc::new(store),
            facts,
        })
    }

    /// The engine's facts the store was made with.
    #[getter]
    fn fingerprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.facts {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The length every page has (`fingerprint["page_bytes"]`), or None.
    #[getter]
    fn page_bytes(&self) -> Option<usize> {
        self.store.page_bytes()
    }

    /// The name the tiers file page `key` of `namespace` under
    /// (`kvrs:{fingerprint}:{namespace}:{key}`, hex hashes): for tools and tests.
    #[pyo3(signature = (key, namespace = None))]
    fn tier_key(&self, key: &str, namespace: Option<&str>) -> String {
        self.store.tier_key(key, namespace.unwrap_or(""))
    }

    /// Seals each page and stores it under its key (in `namespace`; None: the default
    /// one) in the tiers; per page, whether a tier took it (False: refused or failed,
    /// and not visible). One batched request per tier, without the GIL.
    #[pyo3(signature = (keys, pages, namespace = None))]
    fn put_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_arg(keys)?;
        let pages = pages_arg(pages, keys.len())?;
        for (i, p) in pages.iter().enumerate() {
            self.store.check_len("pages", i, p.bytes().len()).py()?;
        }
        let slices: Vec<&[u8]> = pages.iter().map(PageBytes::bytes).collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ns = namespace.unwrap_or("");
        let store = &self.store;
        Ok(py.detach(|| store.put_many(&ks, &slices, ns)))
    }

    /// Looks each key up (in `namespace`) and copies its page, once verified, into its
    /// buffer (writable, C-contiguous, of the page's length), or straight into its
    /// segments when the buffer is a list or tuple of them (the page's bytes in order);
    /// per key, whether it was loaded (False: a miss, the buffer untouched). One batched
    /// request per tier, without the GIL.
    #[pyo3(signature = (keys, buffers, namespace = None))]
    fn get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_arg(keys)?;
        let mut bufs = segments_arg(buffers, keys.len())?;
        for (i, segs) in bufs.iter().enumerate() {
            let len = segs.iter().map(|b| b.bytes().len()).sum();
            self.store.check_len("buffers", i, len).py()?;
        }
        if let Some((i, j)) = first_overlap(&bufs) {
            let whose = if i == j {
                "another of its segments"
            } else {
                "another key's buffer"
            };
            return Err(PyValueError::new_err(format!(
                "buffers[{i}] shares memory with {whose} (buffers[{j}]): give each key, and each \
                 segment, memory of its own"
            )));
        }
        let mut slices: Vec<Vec<&mut [u8]>> = bufs
            .iter_mut()
            .map(|segs| segs.iter_mut().map(PageBytes::bytes_mut).collect())
            .collect();
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ns = namespace.unwrap_or("");
        let store = &self.store;
        Ok(py.detach(|| store.get_into_segments(&ks, &mut slices, ns)))
    }

    /// How many of `keys`, from the first, are stored (in `namespace`): present in a
    /// tier at a valid length; a page is verified when it is read.
    #[pyo3(signature = (keys, namespace = None))]
    fn exists_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<usize> {
        let keys = keys_arg(keys)?;
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ns = namespace.unwrap_or("");
        let store = &self.store;
        Ok(py.detach(|| store.exists_prefix(&ks, ns)))
    }

    /// Whether each of `keys` is stored (in `namespace`): present in a tier at a valid
    /// length (a page is verified when it is read). One batched request per tier (only
    /// for the keys the faster tiers missed), without the GIL.
    #[pyo3(signature = (keys, namespace = None))]
    fn exists_many(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        namespace: Option<&str>,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_arg(keys)?;
        let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
        let ns = namespace.unwrap_or("");
        let store = &self.store;
        Ok(py.detach(|| store.exists_many(&ks, ns)))
    }

    /// Removes every page of `namespace` (this store's fingerprint's) from every tier;
    /// how many tier entries were removed.
    fn drop_namespace(&self, py: Python<'_>, namespace: &str) -> usize {
        let store = &self.store;
        py.detach(|| store.drop_namespace(namespace))
    }

    /// What the store did (`puts`, `stored`, `gets`, `hits`, `hit_bytes`, `rejected`,
    /// `promoted`), and each tier's counters under `tiers`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.store.counters().snapshot() {
            d.set_item(k, v)?;
        }
        let tiers = PyList::empty(py);
        for t in self.store.tiers() {
            let e = PyDict::new(py);
            e.set_item("name", t.name())?;
            for (k, v) in t.counters().snapshot() {
                e.set_item(k, v)?;
            }
            tiers.append(e)?;
        }
        d.set_item("tiers", tiers)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let names: Vec<&str> = self.store.tiers().iter().map(|t| t.name()).collect();
        format!(
            "PageStore(tiers={names:?}, fingerprint={}, keyed={})",
            self.store.fingerprint_hex(),
            self.store.is_keyed()
        )
    }
}
