//! `tollgate render envoy` for a priced domain (LLM spend budgets): what Envoy 1.40 must send so
//! that a request holds its cost before it is forwarded and settles its usage when it is done.
//!
//! * A Lua filter, before the ratelimit filter, reads the request body's `model` and
//!   `max_completion_tokens` (else `max_tokens`, else 0: the model's default) into dynamic
//!   metadata (`tollgate:model`, `tollgate:max_tokens`). On the response it passes the body
//!   through chunk by chunk, keeping only its tail, and reads the last `usage` object in it: an
//!   OpenAI-style JSON response's, or a streamed response's final usage event. It sets the four
//!   usage kinds, disjoint: `input` is `prompt_tokens` less the cached tokens (OpenAI counts those
//!   inside it; Anthropic's `input_tokens` already excludes cached and cache-write tokens).
//! * The ratelimit filter's own `rate_limits`: one entry with the path down to the request id
//!   (`x-request-id`, which Envoy sets on every request, unless the node names a source) and
//!   `hits_addend` = the held output tokens; four entries at stream end, one per usage kind, the
//!   same path and a `usage` entry, `hits_addend` = that kind's count. Envoy sends no descriptor
//!   whose count it cannot read (a response without usage, Envoy's own 429): nothing is settled,
//!   and the hold expires as `on_lost_settle` says.

use serde_json::{json, Value};

use super::{action, JwtPayload, RenderError};
use crate::config::{Domain, Priced, Source};
use crate::limiter::USAGE_KEY;
use crate::matcher::{Level, Node};

/// The Lua filter that fills the `tollgate` metadata the entries read.
pub fn lua_filter() -> Value {
    json!({
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": { "inline_string": LUA },
        },
    })
}

const LUA: &str = r#"function envoy_on_request(handle)
  local body = handle:body()
  local text = body and body:getBytes(0, body:length()) or ""
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set("tollgate", "model", string.match(text, '"model"%s*:%s*"([^"]*)"') or "")
  local max = string.match(text, '"max_completion_tokens"%s*:%s*(%d+)') or string.match(text, '"max_tokens"%s*:%s*(%d+)')
  meta:set("tollgate", "max_tokens", max or "0")
end

function envoy_on_response(handle)
  local tail = ""
  for chunk in handle:bodyChunks() do
    tail = string.sub(tail .. chunk:getBytes(0, chunk:length()), -16384)
  end
  local usage
  for u in string.gmatch(tail, '"usage"%s*:%s*(%b{})') do usage = u end
  if not usage then return end
  local function count(name)
    return tonumber(string.match(usage, '"' .. name .. '"%s*:%s*(%d+)'))
  end
  local cached = count("cached_tokens") or count("cache_read_input_tokens") or 0
  local written = count("cache_creation_input_tokens") or 0
  local input = count("input_tokens")
  if count("prompt_tokens") then input = math.max(0, count("prompt_tokens") - cached - written) end
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set("tollgate", "input", tostring(input or 0))
  meta:set("tollgate", "cached_input", tostring(cached))
  meta:set("tollgate", "cache_write", tostring(written))
  meta:set("tollgate", "output", tostring(count("completion_tokens") or count("output_tokens") or 0))
end
"#;

/// The ratelimit filter's `rate_limits` for priced `domain`: one entry per path down to a
/// request id, and four at stream end.
pub fn rate_limits(domain: &Domain, priced: &Priced, jwt: &JwtPayload) -> Result<Vec<Value>, RenderError> {
    let mut out = Vec::new();
    walk(domain, priced, &domain.root, jwt, &[], &mut out)?;
    Ok(out)
}

fn walk(
    domain: &Domain,
    priced: &Priced,
    level: &Level,
    jwt: &JwtPayload,
    actions: &[Value],
    out: &mut Vec<Value>,
) -> Result<(), RenderError> {
    for node in level.nodes() {
        let mut path = actions.to_vec();
        path.push(node_action(domain, priced, node, jwt)?);
        if node.key == priced.request_id_key {
            out.push(json!({
                "actions": path,
                "hits_addend": { "format": "%DYNAMIC_METADATA(tollgate:max_tokens)%" },
            }));
            for kind in crate::budget::Kind::ALL {
                let mut settle = path.clone();
                settle.push(json!({ "generic_key": { "descriptor_key": USAGE_KEY, "descriptor_value": kind.name() } }));
                out.push(json!({
                    "actions": settle,
                    "apply_on_stream_done": true,
                    "hits_addend": { "format": format!("%DYNAMIC_METADATA(tollgate:{})%", kind.name()) },
                }));
            }
        }
        walk(domain, priced, &node.children, jwt, &path, out)?;
    }
    Ok(())
}

// The action for `node`: its source; the model from the request body; the request id from
// `x-request-id` unless a source is given.
fn node_action(
    domain: &Domain,
    priced: &Priced,
    node: &Node,
    jwt: &JwtPayload,
) -> Result<Value, RenderError> {
    match &node.source {
        Some(source) => Ok(action(&node.key, source, jwt)),
        None if node.key == priced.model_key => Ok(json!({ "metadata": {
            "descriptor_key": node.key,
            "source": "DYNAMIC",
            "metadata_key": { "key": "tollgate", "path": [{ "key": "model" }] },
            "default_value": "_no_model",
        }})),
        None if node.key == priced.request_id_key => {
            Ok(action(&node.key, &Source::RequestHeader("x-request-id".into()), jwt))
        }
        None => Err(RenderError::NoSource { domain: domain.name.clone(), path: node.key.clone() }),
    }
}
