//! `tollgate render envoy` for a priced domain (LLM spend budgets): what Envoy 1.40 must send so
//! that a request holds its cost before it is forwarded and settles its usage when it is done.
//!
//! * A Lua filter, before the ratelimit filter, reads the request body with a JSON scanner of
//!   its own (top-level members only, escapes decoded, nested values skipped) and refuses with
//!   400 and a reason a body that is not a JSON object, whose top-level `model` is missing, not a
//!   string or given twice, or whose `max_tokens` / `max_completion_tokens` is not a whole number
//!   or given twice: a decoy `"model"` inside `metadata` is never what is priced. It puts the
//!   model, the larger of the two token maxima (0 when neither: the model's default; clamped at
//!   10^9, above which Envoy would drop the descriptor and make no call, so the hold still asks
//!   and the service caps it at the model's `max_output_tokens`) and the
//!   body's size in bytes into dynamic metadata (`tollgate:model`, `tollgate:max_tokens`,
//!   `tollgate:input_bytes`). On the response it passes the body through chunk by chunk, keeping
//!   its head and tail: the model the answer names (`tollgate:served_model`) and the last `usage`
//!   object (an OpenAI-style JSON response's, or a streamed response's final usage event). It
//!   sets the four usage kinds, disjoint: `input` is `prompt_tokens` less the cached tokens
//!   (OpenAI counts those inside it; Anthropic's `input_tokens` already excludes cached and
//!   cache-write tokens).
//! * The ratelimit filter's own `rate_limits`: one entry with the path down to the request id,
//!   the body size (`input_bytes_key`) right before it and `hits_addend` = the held output
//!   tokens; four entries at stream end, one per usage kind, the same path, the served model if
//!   the answer named one, and a `usage` entry, `hits_addend` = that kind's count. An error
//!   answer without usage (not 2xx: the provider bills nothing for it) sets every kind to 0, so
//!   that its hold settles at zero; Envoy sends no descriptor whose count it cannot read, so a
//!   2xx without usage (a stream cut short), a request refused here or Envoy's own 429 settles
//!   nothing, and a hold expires as `on_lost_settle` says.
//! * The request id is `x-request-id` unless the node names a source. The connection manager
//!   must make it Envoy's own ([`connection_manager`]: `use_remote_address`, the client's header
//!   not preserved), since a client that chooses its id could pair its requests with one hold.
//!   Header sources skip an absent header (`skip_if_absent`), so a request without one sends a
//!   path with a level missing, which tollgate refuses, instead of no descriptor at all, which
//!   Envoy would let through.
//! * The filter fails closed (`failure_mode_deny: true`): a priced domain's `failure_mode` is
//!   `deny` unless its file says `allow`.

use serde_json::{json, Value};

use super::{action, JwtPayload, RenderError};
use crate::config::{Domain, Priced, Source};
use crate::limiter::{SERVED_MODEL_KEY, USAGE_KEY};
use crate::matcher::{Level, Node};

/// What the HTTP connection manager in front of a priced domain must set: Envoy makes the
/// `x-request-id` of every request from outside (since 1.40 no downstream address is internal
/// unless `internal_address_config` lists it; no client may reach the listener from a listed
/// one), so no client picks the id its hold is recorded under.
pub fn connection_manager() -> Value {
    json!({ "use_remote_address": true, "preserve_external_request_id": false })
}

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

const LUA: &str = r#"-- A JSON object's top-level members: name -> list of {type, value} (strings decoded, whole
-- numbers read, nested values skipped), or nil and why the text is not one.
local function members(text)
  local pos, n = 1, #text
  local function ws() pos = string.find(text, "[^ \t\r\n]", pos) or n + 1 end
  local function utf8(c)
    if c < 0x80 then return string.char(c) end
    if c < 0x800 then return string.char(0xC0 + math.floor(c / 0x40), 0x80 + c % 0x40) end
    if c < 0x10000 then
      return string.char(0xE0 + math.floor(c / 0x1000), 0x80 + math.floor(c / 0x40) % 0x40, 0x80 + c % 0x40)
    end
    return string.char(0xF0 + math.floor(c / 0x40000), 0x80 + math.floor(c / 0x1000) % 0x40,
      0x80 + math.floor(c / 0x40) % 0x40, 0x80 + c % 0x40)
  end
  local escapes = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
  local function str()
    local out = {}
    pos = pos + 1
    while true do
      local at = string.find(text, '["\\]', pos)
      if not at then return nil end
      out[#out + 1] = string.sub(text, pos, at - 1)
      if string.sub(text, at, at) == '"' then
        pos = at + 1
        return table.concat(out)
      end
      local e = string.sub(text, at + 1, at + 1)
      if escapes[e] then
        out[#out + 1] = escapes[e]
        pos = at + 2
      elseif e == "u" then
        local c = tonumber(string.sub(text, at + 2, at + 5), 16)
        if not c then return nil end
        pos = at + 6
        if c >= 0xD800 and c < 0xDC00 and string.sub(text, pos, pos + 1) == "\\u" then
          local low = tonumber(string.sub(text, pos + 2, pos + 5), 16)
          if low and low >= 0xDC00 and low < 0xE000 then
            c = 0x10000 + (c - 0xD800) * 0x400 + (low - 0xDC00)
            pos = pos + 6
          end
        end
        out[#out + 1] = utf8(c)
      else
        return nil
      end
    end
  end
  -- Reads past a value; its type and, for strings and whole numbers, its value.
  local function value()
    ws()
    local c = string.sub(text, pos, pos)
    if c == '"' then
      local s = str()
      if s == nil then return nil end
      return "string", s
    elseif c == "{" or c == "[" then
      local depth = 0
      repeat
        local at = string.find(text, '[][{}"]', pos)
        if not at then return nil end
        local d = string.sub(text, at, at)
        pos = at
        if d == '"' then
          if str() == nil then return nil end
        else
          depth = depth + ((d == "{" or d == "[") and 1 or -1)
          pos = at + 1
        end
      until depth == 0
      return "nested"
    end
    local token = string.match(text, "^[^,}%] \t\r\n]+", pos)
    if not token then return nil end
    pos = pos + #token
    if string.match(token, "^%d+$") then return "number", tonumber(token) end
    return "other", token
  end
  ws()
  if string.sub(text, pos, pos) ~= "{" then return nil, "the body is not a JSON object" end
  pos = pos + 1
  local found = {}
  ws()
  if string.sub(text, pos, pos) == "}" then return found end
  while true do
    ws()
    if string.sub(text, pos, pos) ~= '"' then return nil, "the body is not valid JSON" end
    local name = str()
    ws()
    if name == nil or string.sub(text, pos, pos) ~= ":" then return nil, "the body is not valid JSON" end
    pos = pos + 1
    local kind, v = value()
    if kind == nil then return nil, "the body is not valid JSON" end
    found[name] = found[name] or {}
    table.insert(found[name], { kind, v })
    ws()
    local c = string.sub(text, pos, pos)
    pos = pos + 1
    if c == "}" then return found end
    if c ~= "," then return nil, "the body is not valid JSON" end
  end
end

function envoy_on_request(handle)
  local body = handle:body()
  local text = body and body:getBytes(0, body:length()) or ""
  local function refuse(why)
    handle:streamInfo():dynamicMetadata():set("tollgate", "refused", "1")
    handle:respond({ [":status"] = "400", ["content-type"] = "text/plain" }, why .. "\n")
  end
  local found, why = members(text)
  if not found then return refuse(why) end
  local model = found["model"]
  if not model then return refuse("the body has no top-level \"model\"") end
  if #model > 1 then return refuse("the body gives \"model\" more than once") end
  if model[1][1] ~= "string" or model[1][2] == "" then return refuse("\"model\" is not a model name") end
  local max = 0
  for _, name in ipairs({ "max_tokens", "max_completion_tokens" }) do
    local given = found[name]
    if given then
      if #given > 1 then return refuse("the body gives \"" .. name .. "\" more than once") end
      if given[1][1] ~= "number" then return refuse("\"" .. name .. "\" is not a whole number") end
      if given[1][2] > max then max = given[1][2] end
    end
  end
  -- Envoy drops a descriptor whose hits_addend is above 1e9 and then makes no call at all
  -- (failure_mode_deny never applies): clamp, so that the hold is asked and the service caps
  -- it at the model's max_output_tokens. A run of digits too long for a number is one too.
  if max > 1000000000 then max = 1000000000 end
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set("tollgate", "model", model[1][2])
  meta:set("tollgate", "max_tokens", string.format("%d", max))
  meta:set("tollgate", "input_bytes", tostring(#text))
end

function envoy_on_response(handle)
  local head, tail = "", ""
  for chunk in handle:bodyChunks() do
    local bytes = chunk:getBytes(0, chunk:length())
    if #head < 4096 then head = head .. string.sub(bytes, 1, 4096 - #head) end
    tail = string.sub(tail .. bytes, -16384)
  end
  local meta = handle:streamInfo():dynamicMetadata()
  local served = string.match(head, '"model"%s*:%s*"([^"]*)"')
  if served and served ~= "" then meta:set("tollgate", "served_model", served) end
  local usage
  for u in string.gmatch(tail, '"usage"%s*:%s*(%b{})') do usage = u end
  if not usage then
    -- An error answer without usage (the provider's 4xx or 5xx, Envoy's own 503 for an
    -- upstream it could not reach) is billed nothing: the hold settles at zero rather than
    -- expiring into a charge of all of it. Not for a request that holds nothing (refused
    -- here, or Envoy's own 429), nor a 2xx without usage (a stream cut short): that one
    -- expires as on_lost_settle says.
    local status = tonumber(handle:headers():get(":status")) or 0
    local refused = meta:get("tollgate") and meta:get("tollgate")["refused"]
    if (status >= 200 and status < 300) or refused or handle:headers():get("x-envoy-ratelimited") then
      return
    end
    usage = ""
  end
  local function count(name)
    return tonumber(string.match(usage, '"' .. name .. '"%s*:%s*(%d+)'))
  end
  local cached = count("cached_tokens") or count("cache_read_input_tokens") or 0
  local written = count("cache_creation_input_tokens") or 0
  local input = count("input_tokens")
  if count("prompt_tokens") then input = math.max(0, count("prompt_tokens") - cached - written) end
  meta:set("tollgate", "input", tostring(input or 0))
  meta:set("tollgate", "cached_input", tostring(cached))
  meta:set("tollgate", "cache_write", tostring(written))
  meta:set("tollgate", "output", tostring(count("completion_tokens") or count("output_tokens") or 0))
end
"#;

// An action reading `field` of the `tollgate` metadata into entry `key`; with `skip_if_absent`,
// the entry is left out when the field is not set.
fn metadata(key: &str, field: &str, skip_if_absent: bool) -> Value {
    let mut action = json!({ "metadata": {
        "descriptor_key": key,
        "source": "DYNAMIC",
        "metadata_key": { "key": "tollgate", "path": [{ "key": field }] },
    }});
    if skip_if_absent {
        action["metadata"]["skip_if_absent"] = json!(true);
    }
    action
}

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
        if node.key == domain.request_id_key {
            // The body's size goes right before the request id.
            let mut path = path.clone();
            let id = path.pop().expect("just pushed");
            path.push(metadata(&priced.input_bytes_key, "input_bytes", false));
            path.push(id);
            out.push(json!({
                "actions": path,
                "hits_addend": { "format": "%DYNAMIC_METADATA(tollgate:max_tokens)%" },
            }));
            for kind in crate::budget::Kind::ALL {
                let mut settle = path.clone();
                settle.push(metadata(SERVED_MODEL_KEY, "served_model", true));
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
    let mut action = match &node.source {
        Some(source) => action(&node.key, source, jwt),
        None if node.key == priced.model_key => {
            let mut model = metadata(&node.key, "model", false);
            model["metadata"]["default_value"] = json!("_no_model");
            model
        }
        None if node.key == domain.request_id_key => {
            action(&node.key, &Source::RequestHeader("x-request-id".into()), jwt)
        }
        None => return Err(RenderError::NoSource { domain: domain.name.clone(), path: node.key.clone() }),
    };
    // An absent header leaves its level out of the path (refused by tollgate) rather than the
    // whole descriptor (let through by Envoy).
    if let Some(headers) = action.get_mut("request_headers") {
        headers["skip_if_absent"] = json!(true);
    }
    Ok(action)
}
