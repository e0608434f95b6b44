// Request signing for the dashboard, byte for byte what node/acl.py's sign_headers computes:
//   HMAC-SHA256(secret, METHOD \n canonical target \n timestamp \n nonce \n hex SHA-256(body))
// canonical target = path percent-decoded then re-encoded (unreserved plus "/-_.~%|@:" kept),
// then "?" and the query pairs (decoded as parse_qsl does) sorted and re-encoded ("-_.~" kept).
// Uses WebCrypto (crypto.subtle), which browsers offer on https and on http://127.0.0.1.
"use strict";

const MQSign = (() => {
  const enc = new TextEncoder();
  const dec = new TextDecoder("utf-8");        // invalid UTF-8 -> U+FFFD, as Python's errors="replace"
  const HEX = "0123456789ABCDEF";
  const ALWAYS_SAFE = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~";

  function isHex(c) {
    return /^[0-9A-Fa-f]$/.test(c);
  }

  // urllib.parse.unquote: %XX sequences become bytes, the bytes are read as UTF-8;
  // a "%" not followed by two hex digits stays as it is.
  function unquote(s) {
    if (s.indexOf("%") < 0) return s;
    const bytes = [];
    for (let i = 0; i < s.length;) {
      if (s[i] === "%" && i + 2 < s.length && isHex(s[i + 1]) && isHex(s[i + 2])) {
        bytes.push(parseInt(s.substr(i + 1, 2), 16));
        i += 3;
      } else {
        const cp = s.codePointAt(i);
        const ch = String.fromCodePoint(cp);
        for (const b of enc.encode(ch)) bytes.push(b);
        i += ch.length;
      }
    }
    return dec.decode(new Uint8Array(bytes));
  }

  // urllib.parse.quote(s, safe): UTF-8 bytes, every byte outside ALWAYS_SAFE + safe as %XX (upper case).
  function quote(s, safe) {
    const keep = ALWAYS_SAFE + safe;
    let out = "";
    for (const b of enc.encode(s)) {
      const c = String.fromCharCode(b);
      out += b < 128 && keep.indexOf(c) >= 0 ? c : "%" + HEX[b >> 4] + HEX[b & 15];
    }
    return out;
  }

  // urllib.parse.parse_qsl(q, keep_blank_values=True): split on "&", skip empty parts,
  // "+" is a space, a part without "=" has the value "".
  function parseQsl(q) {
    const pairs = [];
    for (const part of q.split("&")) {
      if (!part) continue;
      const i = part.indexOf("=");
      const k = i < 0 ? part : part.slice(0, i);
      const v = i < 0 ? "" : part.slice(i + 1);
      pairs.push([unquote(k.replace(/\+/g, " ")), unquote(v.replace(/\+/g, " "))]);
    }
    return pairs;
  }

  // Python compares strings by code point; UTF-8 byte order is the same order.
  function cmpStr(a, b) {
    const x = enc.encode(a), y = enc.encode(b);
    const n = Math.min(x.length, y.length);
    for (let i = 0; i < n; i++) if (x[i] !== y[i]) return x[i] - y[i];
    return x.length - y.length;
  }

  function canonicalTarget(path, pairs) {
    let out = quote(unquote(path), "/-_.~%|@:");
    if (pairs.length) {
      const sorted = pairs.slice().sort((a, b) => cmpStr(a[0], b[0]) || cmpStr(a[1], b[1]));
      out += "?" + sorted.map(([k, v]) => `${quote(k, "-_.~")}=${quote(v, "-_.~")}`).join("&");
    }
    return out;
  }

  // The canonical target of a URL as the browser will send it (its pathname and search).
  function targetOf(url) {
    const u = new URL(url, location.href);
    return canonicalTarget(u.pathname, parseQsl(u.search.replace(/^\?/, "")));
  }

  function hex(buf) {
    return Array.from(new Uint8Array(buf), b => b.toString(16).padStart(2, "0")).join("");
  }

  async function sha256Hex(bytes) {
    return hex(await crypto.subtle.digest("SHA-256", bytes));
  }

  async function hmacHex(secret, text) {
    const key = await crypto.subtle.importKey("raw", enc.encode(secret), { name: "HMAC", hash: "SHA-256" },
      false, ["sign"]);
    return hex(await crypto.subtle.sign("HMAC", key, enc.encode(text)));
  }

  function newNonce() {
    const raw = crypto.getRandomValues(new Uint8Array(18));
    return btoa(String.fromCharCode(...raw)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function bodyBytes(body) {
    if (body === undefined || body === null) return new Uint8Array(0);
    return typeof body === "string" ? enc.encode(body) : new Uint8Array(body);
  }

  async function signature(secret, method, target, ts, nonce, body) {
    const text = [method.toUpperCase(), target, ts, nonce, await sha256Hex(bodyBytes(body))].join("\n");
    return hmacHex(secret, text);
  }

  // The four X-MQ-* headers for one request to `url` (relative to the page).
  async function headers(accessKey, secretKey, method, url, body, nowMs, nonce) {
    const ts = String(Math.floor(nowMs === undefined ? Date.now() : nowMs));
    nonce = nonce || newNonce();
    const sig = await signature(secretKey, method, targetOf(url), ts, nonce, body);
    return { "X-MQ-AccessKey": accessKey, "X-MQ-Timestamp": ts, "X-MQ-Nonce": nonce, "X-MQ-Signature": sig };
  }

  return { unquote, quote, parseQsl, canonicalTarget, targetOf, signature, headers, newNonce };
})();

if (typeof window !== "undefined") window.MQSign = MQSign;
