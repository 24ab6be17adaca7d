//! Tolerant field decoders: Proxmox sends numbers as strings, booleans as 0/1/""
//! and `null` for absent values, depending on version and endpoint. Malformed values
//! (a non-numeric string where a number belongs) are still errors.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

fn value_to_f64(v: &Value) -> Result<Option<f64>, String> {
    match v {
        Value::Null => Ok(None),
        Value::Number(n) => Ok(n.as_f64()),
        Value::Bool(b) => Ok(Some(if *b { 1.0 } else { 0.0 })),
        Value::String(s) => {
            let t = s.trim();
            if t.is_empty() {
                return Ok(None);
            }
            t.parse::<f64>()
                .map(Some)
                .map_err(|_| format!("expected a number, got string {s:?}"))
        }
        other => Err(format!("expected a number, got {other}")),
    }
}

fn value_to_i64(v: &Value) -> Result<Option<i64>, String> {
    match v {
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Ok(Some(i))
            } else if let Some(u) = n.as_u64() {
                i64::try_from(u)
                    .map(Some)
                    .map_err(|_| format!("number {u} out of range"))
            } else {
                // exponent notation from some storage plugins
                n.as_f64()
                    .filter(|f| f.is_finite())
                    .map(|f| Some(f.round() as i64))
                    .ok_or_else(|| format!("expected an integer, got {n}"))
            }
        }
        Value::String(s) => {
            let t = s.trim();
            if t.is_empty() {
                return Ok(None);
            }
            if let Ok(i) = t.parse::<i64>() {
                return Ok(Some(i));
            }
            t.parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .map(|f| Some(f.round() as i64))
                .ok_or_else(|| format!("expected an integer, got string {s:?}"))
        }
        other => value_to_f64(other).map(|o| o.map(|f| f as i64)),
    }
}

fn value_to_bool(v: &Value) -> Result<Option<bool>, String> {
    match v {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        Value::Number(n) => Ok(Some(n.as_f64().unwrap_or(0.0) != 0.0)),
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "" | "0" | "false" | "off" | "no" => Ok(Some(false)),
            "1" | "true" | "on" | "yes" => Ok(Some(true)),
            _ => Err(format!("expected a boolean, got string {s:?}")),
        },
        other => Err(format!("expected a boolean, got {other}")),
    }
}

/// Optional integer from a number, numeric string, `null` or `""`.
pub fn opt_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let v = Value::deserialize(d)?;
    value_to_i64(&v).map_err(D::Error::custom)
}

/// Optional unsigned integer (negative values are errors).
pub fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match opt_i64(d)? {
        None => Ok(None),
        Some(i) => u64::try_from(i)
            .map(Some)
            .map_err(|_| D::Error::custom(format!("expected a non-negative integer, got {i}"))),
    }
}

/// Unsigned integer that defaults to 0 when absent or null.
pub fn u64_or_zero<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    Ok(opt_u64(d)?.unwrap_or(0))
}

/// Optional float from a number or numeric string.
pub fn opt_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    let v = Value::deserialize(d)?;
    value_to_f64(&v).map_err(D::Error::custom)
}

/// Float that defaults to 0.0.
pub fn f64_or_zero<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(opt_f64(d)?.unwrap_or(0.0))
}

/// Boolean from `true/false`, `0/1`, `"0"/"1"`, `""`; absent/null = false.
pub fn bool_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    let v = Value::deserialize(d)?;
    Ok(value_to_bool(&v)
        .map_err(D::Error::custom)?
        .unwrap_or(false))
}

/// A VMID: integer or numeric string, required and in the valid range.
pub fn vmid<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = Value::deserialize(d)?;
    let i = value_to_i64(&v)
        .map_err(D::Error::custom)?
        .ok_or_else(|| D::Error::custom("vmid is missing"))?;
    u32::try_from(i).map_err(|_| D::Error::custom(format!("vmid {i} out of range")))
}

/// Optional VMID.
pub fn opt_vmid<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let v = Value::deserialize(d)?;
    match value_to_i64(&v).map_err(D::Error::custom)? {
        None => Ok(None),
        Some(i) => u32::try_from(i)
            .map(Some)
            .map_err(|_| D::Error::custom(format!("vmid {i} out of range"))),
    }
}

/// Optional string that may arrive as a number (e.g. task `id`).
pub fn opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        Value::Number(n) => Ok(Some(n.to_string())),
        Value::Bool(b) => Ok(Some(if b { "1" } else { "0" }.to_string())),
        other => Err(D::Error::custom(format!("expected a string, got {other}"))),
    }
}

/// A value that may also arrive as `null`: the type's default then (absent fields need
/// `#[serde(default)]` as well).
pub fn or_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Float list from numbers or numeric strings (`loadavg`).
pub fn f64_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
    let v = Value::deserialize(d)?;
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .map(|i| value_to_f64(i).map(|o| o.unwrap_or(0.0)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(D::Error::custom),
        other => Err(D::Error::custom(format!("expected a list, got {other}"))),
    }
}

/// Splits a Proxmox tag string (`a;b`, also lenient on `,` and spaces) into a sorted, deduplicated set.
pub fn split_tags(tags: &str) -> Vec<String> {
    let mut out: Vec<String> = tags
        .split(|c: char| c == ';' || c == ',' || c.is_whitespace())
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Tag list from a `;`-joined string.
pub fn tags<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(opt_string(d)?.map(|s| split_tags(&s)).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct T {
        #[serde(default, deserialize_with = "opt_u64")]
        n: Option<u64>,
        #[serde(default, deserialize_with = "bool_lenient")]
        b: bool,
        #[serde(deserialize_with = "vmid")]
        vmid: u32,
        #[serde(default, deserialize_with = "tags")]
        tags: Vec<String>,
    }

    fn parse(s: &str) -> Result<T, serde_json::Error> {
        serde_json::from_str(s)
    }

    #[test]
    fn tolerant_values() {
        let t = parse(r#"{"n":"1606311524","b":"","vmid":"100","tags":"one, two; three"}"#)
            .expect("decodes");
        assert_eq!(t.n, Some(1606311524));
        assert!(!t.b);
        assert_eq!(t.vmid, 100);
        assert_eq!(t.tags, vec!["one", "three", "two"]);
        let t = parse(r#"{"n":1.12589990684262e+15,"b":1,"vmid":101}"#).expect("decodes");
        assert_eq!(t.n, Some(1_125_899_906_842_620));
        assert!(t.b);
        let t = parse(r#"{"n":null,"b":"1","vmid":101}"#).expect("decodes");
        assert_eq!(t.n, None);
        assert!(t.b);
    }

    #[test]
    fn strict_where_it_matters() {
        assert!(parse(r#"{"vmid":"abc"}"#).is_err());
        assert!(parse(r#"{"vmid":101,"n":"lots"}"#).is_err());
        assert!(parse(r#"{"vmid":101,"n":-5}"#).is_err());
        assert!(parse(r#"{"vmid":101,"b":"maybe"}"#).is_err());
        assert!(parse(r#"{"n":1}"#).is_err());
    }
}
