//! The Python face of a pool's recurrent state slots (the core's `paged::states`): the
//! constructor's `state_*` arguments, and zero-copy views of one sequence's states or of
//! a whole state layer, keyed by state name.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::parse_dtype;
use super::errors::ToPython;
use super::views::borrowed_view;
use kvrs::unstable::{check_index, check_size, PoolCore, StateConfig, StateSpec};
use kvrs::{DType, Device, KvError};

/// Where a pool's states live, fixed for its life: read once, without the lock, by the
/// views.
#[derive(Clone, Debug)]
pub struct StateLayout {
    /// The layers, slots and states.
    pub config: StateConfig,
    /// Address of each state's storage (never reallocated).
    pub bases: Vec<usize>,
}

impl StateLayout {
    /// The layout of `core`'s states, if it has state layers.
    pub fn of(core: &PoolCore) -> Option<Self> {
        core.states().map(|a| StateLayout {
            config: a.config().clone(),
            bases: (0..a.config().specs.len())
                .map(|s| a.storage(s).data_ptr() as usize)
                .collect(),
        })
    }

    /// Views of every state of `layer` for `count` slots from `slot`, by name:
    /// `[count, *dims]` each, or `[*dims]` when `single`.
    pub fn views<'py>(
        &self,
        owner: &Bound<'py, PyAny>,
        device: Device,
        layer: i64,
        slot: u32,
        count: usize,
        single: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.config;
        let layer = check_index("layer", layer, c.layers).py()?;
        let out = PyDict::new(owner.py());
        for (s, spec) in c.specs.iter().enumerate() {
            let es = spec.dtype.size();
            let numel = spec.numel();
            let offset = (layer * c.slots + slot as usize) * numel;
            let mut shape = if single { vec![] } else { vec![count] };
            shape.extend_from_slice(&spec.dims);
            let mut strides = vec![0isize; shape.len()];
            let mut acc = es as isize;
            for i in (0..shape.len()).rev() {
                strides[i] = acc;
                acc *= shape[i] as isize;
            }
            // SAFETY: the state storages are never reallocated and live as long as the
            // pool, which `owner` (the pool or one of its sequences) keeps alive; the
            // region lies within the storage (layer and slot range checked).
            let view = unsafe {
                borrowed_view(
                    owner,
                    device,
                    (self.bases[s] + offset * es) as *mut u8,
                    spec.dtype,
                    &shape,
                    &strides,
                    true,
                )?
            };
            out.set_item(&spec.name, view)?;
        }
        Ok(out)
    }

    /// `{name: (dims, dtype name)}`.
    pub fn shapes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for s in &self.config.specs {
            out.set_item(&s.name, (s.dims.clone(), s.dtype.name()))?;
        }
        Ok(out)
    }
}

/// The state configuration of the constructor's arguments: `None` without state layers.
/// `state_shapes` maps each state's name to its shape per sequence; `state_dtype` is one
/// dtype or a dict of one per name (float32 by default).
pub fn parse_config(
    state_layers: i64,
    state_shapes: Option<&Bound<'_, PyAny>>,
    state_slots: Option<i64>,
    state_dtype: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<StateConfig>> {
    let bad = |name, value: String, reason: &str| -> PyErr {
        KvError::InvalidArgument {
            name,
            value,
            reason: reason.into(),
        }
        .py()
    };
    if state_layers < 0 {
        return Err(bad(
            "state_layers",
            state_layers.to_string(),
            "must be >= 0",
        ));
    }
    if state_layers == 0 {
        if state_shapes.is_some() || state_slots.is_some() || state_dtype.is_some() {
            return Err(bad(
                "state_layers",
                "0".into(),
                "state_shapes, state_slots and state_dtype need state_layers >= 1",
            ));
        }
        return Ok(None);
    }
    let shapes = state_shapes.map(|s| {
        s.cast::<PyDict>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "state_shapes must be a dict {{name: shape}}, got {}",
                s.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        })
    });
    let shapes = shapes.transpose()?.ok_or_else(|| {
        bad(
            "state_shapes",
            "None".into(),
            "state layers need their states' shapes, e.g. {'conv': (conv_dim, kernel), \
             'recurrent': (heads, k_dim, v_dim)}",
        )
    })?;
    let slots = state_slots.ok_or_else(|| {
        bad(
            "state_slots",
            "None".into(),
            "state layers need state_slots: how many sequences hold a state at once",
        )
    })?;
    let parse = |x: &Bound<'_, PyAny>| -> PyResult<DType> {
        parse_dtype(x).map_err(|_| {
            bad(
                "state_dtype",
                x.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
                "states are float32, float16 or bfloat16",
            )
        })
    };
    let dtype_of = |name: &str| -> PyResult<DType> {
        match state_dtype {
            None => Ok(DType::F32),
            Some(d) => match d.cast::<PyDict>() {
                Ok(map) => match map.get_item(name)? {
                    Some(x) => parse(&x),
                    None => Ok(DType::F32),
                },
                Err(_) => parse(d),
            },
        }
    };
    if let Some(map) = state_dtype.and_then(|d| d.cast::<PyDict>().ok()) {
        for k in map.keys() {
            if !shapes.contains(&k)? {
                return Err(bad(
                    "state_dtype",
                    k.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
                    "names no state of state_shapes",
                ));
            }
        }
    }
    let mut specs = Vec::with_capacity(shapes.len());
    for (k, v) in shapes.iter() {
        let name: String = k.extract().map_err(|_| {
            bad(
                "state_shapes",
                k.repr().map_or_else(|_| "?".into(), |r| r.to_string()),
                "keys are state names (str)",
            )
        })?;
        let dims: Vec<i64> = v.extract().map_err(|_| {
            bad(
                "state_shapes",
                format!(
                    "{name}: {}",
                    v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                ),
                "each value is a shape: a tuple of ints",
            )
        })?;
        if dims.is_empty() || dims.iter().any(|&d| d < 1) {
            return Err(bad(
                "state_shapes",
                format!("{name}: {dims:?}"),
                "every dimension must be >= 1",
            ));
        }
        let dims = dims.iter().map(|&d| d as usize).collect();
        specs.push(StateSpec {
            dtype: dtype_of(&name)?,
            name,
            dims,
        });
    }
    let config = StateConfig {
        layers: check_size("state_layers", state_layers).py()?,
        slots: check_size("state_slots", slots).py()?,
        checkpoints: 0,
        specs,
    };
    config.validate().py()?;
    Ok(Some(config))
}

/// Default checkpoint slots per state slot of a pool with state layers that caches
/// prefixes.
pub const CHECKPOINTS_PER_SLOT: usize = 2;

/// Default decode checkpoint interval in tokens (rounded up to whole blocks).
pub const CHECKPOINT_TOKENS: usize = 256;

/// Sets `config`'s checkpoint slots from `state_checkpoints` (default: none without
/// prefix caching, else [`CHECKPOINTS_PER_SLOT`] per state slot) and returns the decode
/// checkpoint interval (default [`CHECKPOINT_TOKENS`] rounded up to a multiple of
/// `block_size`; 0 without checkpoints).
pub fn checkpoint_policy(
    config: Option<&mut StateConfig>,
    prefix_caching: bool,
    state_checkpoints: Option<i64>,
    checkpoint_interval: Option<i64>,
    block_size: usize,
) -> PyResult<usize> {
    let Some(config) = config else {
        if state_checkpoints.is_some() || checkpoint_interval.is_some() {
            return Err(KvError::InvalidArgument {
                name: "state_checkpoints",
                value: "given".into(),
                reason: "state_checkpoints and checkpoint_interval need state_layers >= 1".into(),
            }
            .py());
        }
        return Ok(0);
    };
    if !prefix_caching && state_checkpoints.is_some_and(|c| c > 0) {
        return Err(KvError::InvalidArgument {
            name: "state_checkpoints",
            value: state_checkpoints.unwrap_or(0).to_string(),
            reason: "checkpoints are keyed by the prefix cache's hash chains: pass \
                     prefix_caching=True (or leave state_checkpoints out)"
                .into(),
        }
        .py());
    }
    config.checkpoints = match state_checkpoints {
        Some(c) => kvrs::unstable::check_count("state_checkpoints", c).py()?,
        None if prefix_caching => config.slots.saturating_mul(CHECKPOINTS_PER_SLOT),
        None => 0,
    };
    if config.checkpoints == 0 {
        return Ok(0);
    }
    Ok(match checkpoint_interval {
        Some(n) => kvrs::unstable::check_count("checkpoint_interval", n).py()?,
        None => CHECKPOINT_TOKENS.div_ceil(block_size) * block_size,
    })
}
