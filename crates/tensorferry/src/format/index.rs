//! Sharded checkpoints: `model.safetensors.index.json` and its `weight_map`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path};

use super::FormatError;

/// The usual file name of a sharded checkpoint's index.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// A parsed, validated index: which shard holds each tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Index {
    /// The index's `metadata` object (e.g. `total_size`), if any.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Tensor name -> shard file name (relative to the index's directory), sorted by name.
    pub weight_map: BTreeMap<String, String>,
}

impl Index {
    /// Shard file names, sorted, each once.
    pub fn shards(&self) -> Vec<&str> {
        let mut seen = std::collections::HashSet::new();
        let mut out: Vec<&str> = self
            .weight_map
            .values()
            .filter(|s| seen.insert(s.as_str()))
            .map(String::as_str)
            .collect();
        out.sort_unstable();
        out
    }
}

/// Parses an index file's bytes. Refuses shard names that are absolute or contain `..`,
/// and tensors listed twice.
pub fn parse_index(bytes: &[u8]) -> Result<Index, FormatError> {
    #[derive(serde::Deserialize)]
    struct Raw {
        #[serde(default)]
        metadata: Option<serde_json::Map<String, serde_json::Value>>,
        weight_map: DupCheckedMap,
    }
    let raw: Raw = serde_json::from_slice(bytes).map_err(|e| FormatError::BadIndex {
        message: e.to_string(),
    })?;
    let mut weight_map = BTreeMap::new();
    for (name, shard) in raw.weight_map.0 {
        check_shard_name(&shard)?;
        if weight_map.insert(name.clone(), shard).is_some() {
            return Err(FormatError::BadIndex {
                message: format!("tensor {name:?} is listed more than once in weight_map"),
            });
        }
    }
    Ok(Index {
        metadata: raw.metadata,
        weight_map,
    })
}

/// Refuses a shard name that is empty, absolute or steps out with `..`.
pub fn check_shard_name(shard: &str) -> Result<(), FormatError> {
    let path = Path::new(shard);
    let ok = !shard.is_empty()
        && !shard.contains('\0')
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if ok {
        Ok(())
    } else {
        Err(FormatError::UnsafeShardName {
            shard: shard.to_string(),
        })
    }
}

/// A JSON object read as a list, so duplicate keys can be reported.
struct DupCheckedMap(Vec<(String, String)>);

impl<'de> serde::Deserialize<'de> for DupCheckedMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = DupCheckedMap;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object mapping tensor names to shard file names")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(e) = m.next_entry::<String, String>()? {
                    out.push(e);
                }
                Ok(DupCheckedMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Groups tensor names by shard, for planning one submission over all shards.
pub fn by_shard(index: &Index) -> HashMap<&str, Vec<&str>> {
    let mut out: HashMap<&str, Vec<&str>> = HashMap::new();
    for (name, shard) in &index.weight_map {
        out.entry(shard.as_str()).or_default().push(name.as_str());
    }
    out
}
