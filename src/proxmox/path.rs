//! API paths built from input: every segment is percent-encoded (`/`, `.`, `%`, `?`, `#`
//! included), and a segment that is empty, `.` or `..` is refused before anything is sent, so a
//! name like `../../access` can never address another API path. Parameters capmox passes on
//! from a spec are checked against the formats of [`crate::api::names`] here too, so an object
//! stored before those patterns existed is refused, not sent.

use std::collections::BTreeMap;

use crate::api::names::{NameError, NameRule};

use super::error::{ProxmoxError, Result};

/// What is encoded in a segment: everything but letters, digits, `-`, `_`, `~` and the `:`,
/// `@`, `!` of Proxmox ids (UPIDs, token ids, HA resource ids).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'~')
    .remove(b':')
    .remove(b'@')
    .remove(b'!');

/// The reason of the errors of requests capmox refuses to send.
const NOT_SENT: &str = "capmox did not send the request";

/// One path segment, percent-encoded; `param` names it in the error.
pub(crate) fn seg(param: &str, value: &str) -> Result<String> {
    if value.is_empty() || value == "." || value == ".." {
        return Err(refused(
            param,
            format!("{value:?} cannot name a Proxmox object in an API path"),
        ));
    }
    Ok(percent_encoding::utf8_percent_encode(value, SEGMENT).to_string())
}

/// A node name as a path segment: it must be a valid node name first.
pub(crate) fn node_seg(node: &str) -> Result<String> {
    checked("node", NameRule::Node, node)?;
    seg("node", node)
}

/// A storage id as a path segment: it must be a valid storage id first.
pub(crate) fn storage_seg(storage: &str) -> Result<String> {
    checked("storage", NameRule::Storage, storage)?;
    seg("storage", storage)
}

/// `value` of parameter `param` if it has `rule`'s format.
pub(crate) fn checked<'a>(param: &str, rule: NameRule, value: &'a str) -> Result<&'a str> {
    rule.check(value)
        .map(|()| value)
        .map_err(|error: NameError| refused(param, error.to_string()))
}

/// A request refused before sending, in the shape of Proxmox's own parameter errors.
fn refused(param: &str, detail: String) -> ProxmoxError {
    ProxmoxError::InvalidParameters {
        status: 400,
        reason: NOT_SENT.to_owned(),
        errors: BTreeMap::from([(param.to_owned(), detail)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxmox_ids_keep_their_separators() {
        assert_eq!(
            seg(
                "upid",
                "UPID:pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:root@pam!tok:"
            )
            .unwrap(),
            "UPID:pve:00000AC5:0000CCB6:5FBE5E63:qmclone:100:root@pam!tok:"
        );
        assert_eq!(seg("sid", "vm:100").unwrap(), "vm:100");
    }

    #[test]
    fn slashes_dots_and_url_syntax_are_encoded() {
        assert_eq!(
            seg("volume", "local:iso/seed 1.iso").unwrap(),
            "local:iso%2Fseed%201%2Eiso"
        );
        assert_eq!(seg("x", "a?b#c%d").unwrap(), "a%3Fb%23c%25d");
        assert_eq!(
            seg("node", "../../access").unwrap(),
            "%2E%2E%2F%2E%2E%2Faccess"
        );
    }

    #[test]
    fn empty_and_dot_segments_are_refused() {
        for value in ["", ".", ".."] {
            let error = seg("node", value).expect_err(value);
            assert!(
                matches!(&error, ProxmoxError::InvalidParameters { errors, .. } if errors.contains_key("node")),
                "{error}"
            );
        }
    }

    #[test]
    fn node_and_storage_segments_must_be_proxmox_names() {
        let error = node_seg("../../access").expect_err("not a node name");
        assert!(
            error.to_string().contains("not a valid Proxmox node name"),
            "{error}"
        );
        assert!(storage_seg("../local").is_err());
        assert_eq!(node_seg("pve1").unwrap(), "pve1");
        assert_eq!(storage_seg("local-lvm").unwrap(), "local-lvm");
    }
}
