//! Rotary position embeddings, for moving cached keys to new positions: a key rotated at
//! position `p` and then by `delta` equals the key rotated at `p + delta`.

use std::str::FromStr;

use crate::error::{KvError, Result};

/// Which dimensions rotate together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension `i` pairs with `i + rotary_dim / 2` (GPT-NeoX, Llama in Hugging Face).
    Neox,
    /// Dimension `2i` pairs with `2i + 1` (GPT-J, Llama's original weights).
    Gptj,
}

impl FromStr for RopeStyle {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "neox" => Ok(RopeStyle::Neox),
            "gptj" | "gpt-j" => Ok(RopeStyle::Gptj),
            _ => Err(KvError::InvalidArgument {
                name: "style",
                value: format!("{s:?}"),
                reason: "use 'neox' or 'gptj'".into(),
            }),
        }
    }
}

/// A rotary embedding: `theta`, the rotated dimensions, the pairing style and linear
/// position scaling (positions divided by `linear_factor`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base of the frequencies, `theta^(-2i / rotary_dim)`.
    pub theta: f64,
    /// Leading dimensions that rotate (`None`: all of `head_dim`).
    pub rotary_dim: Option<usize>,
    /// Pairing of rotated dimensions.
    pub style: RopeStyle,
    /// Linear scaling factor (1 for none).
    pub linear_factor: f64,
}

impl Rope {
    /// Checks the description against `head_dim` and returns the rotated dimensions.
    pub fn rotary_dim(&self, head_dim: usize) -> Result<usize> {
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return Err(KvError::InvalidArgument {
                name: "theta",
                value: self.theta.to_string(),
                reason: "must be a finite number > 1".into(),
            });
        }
        if !(self.linear_factor.is_finite() && self.linear_factor > 0.0) {
            return Err(KvError::InvalidArgument {
                name: "scaling",
                value: self.linear_factor.to_string(),
                reason: "the linear factor must be > 0".into(),
            });
        }
        let rd = self.rotary_dim.unwrap_or(head_dim);
        if rd == 0 || rd % 2 == 1 || rd > head_dim {
            return Err(KvError::InvalidArgument {
                name: "rotary_dim",
                value: rd.to_string(),
                reason: format!("must be even and in [2, head_dim={head_dim}]"),
            });
        }
        Ok(rd)
    }

    /// Rotates every `head_dim` row of `rows` by the angle of a position change `delta`.
    pub fn rotate(&self, head_dim: usize, rows: &mut [f32], delta: f64) -> Result<()> {
        let rd = self.rotary_dim(head_dim)?;
        let half = rd / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..half)
            .map(|i| {
                let angle =
                    delta / self.linear_factor * self.theta.powf(-2.0 * i as f64 / rd as f64);
                (angle.cos() as f32, angle.sin() as f32)
            })
            .unzip();
        for row in rows.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match self.style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Gptj => (2 * i, 2 * i + 1),
                };
                let (x, y) = (row[a], row[b]);
                row[a] = x * cos[i] - y * sin[i];
                row[b] = x * sin[i] + y * cos[i];
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotations_compose_by_adding_positions() {
        for style in [RopeStyle::Neox, RopeStyle::Gptj] {
            for rotary_dim in [None, Some(4)] {
                let rope = Rope {
                    theta: 10000.0,
                    rotary_dim,
                    style,
                    linear_factor: 2.0,
                };
                let base: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
                let (mut stepwise, mut direct) = (base.clone(), base.clone());
                rope.rotate(8, &mut stepwise, 1000.0).unwrap();
                rope.rotate(8, &mut stepwise, -250.0).unwrap();
                rope.rotate(8, &mut direct, 750.0).unwrap();
                for (a, b) in stepwise.iter().zip(&direct) {
                    assert!((a - b).abs() < 1e-5, "{style:?} {rotary_dim:?}: {a} vs {b}");
                }
                if rotary_dim == Some(4) {
                    assert_eq!(
                        &direct[4..8],
                        &base[4..8],
                        "dimensions past rotary_dim stay"
                    );
                }
            }
        }
    }

    #[test]
    fn invalid_descriptions_are_refused() {
        let mut r = Rope {
            theta: 10000.0,
            rotary_dim: Some(3),
            style: RopeStyle::Neox,
            linear_factor: 1.0,
        };
        assert!(r.rotary_dim(8).is_err());
        r.rotary_dim = Some(10);
        assert!(r.rotary_dim(8).is_err());
        r.rotary_dim = None;
        r.theta = 0.5;
        assert!(r.rotary_dim(8).is_err());
    }
}
