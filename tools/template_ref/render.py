#!/usr/bin/env python3
"""Reference chat-template renderer for lily's template tests (byte-exact oracle).

Renders conversations the way transformers' `apply_chat_template(..., tokenize=False)` does, with
transformers' own code: `_normalize_chat_messages` (drops null-valued keys), then
`render_jinja_template` (transformers' jinja2 environment: ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, its `tojson`, `raise_exception`, reasoning aliasing),
with the tokenizer's `special_tokens_map` plus the caller's kwargs as variables. One extra step is
lily's (and every OpenAI-compatible server's): tool-call `arguments` given as a JSON string are
parsed into an object before rendering. lily's `ChatTemplate::render` does the same steps.

Run it with the oracle venv (`scripts/oracle-setup` prints its python), e.g.

  PY=$(scripts/oracle-setup | tail -n1)
  $PY tools/template_ref/render.py --model DIR --chat chat.json [--tools t.json] \
      [--no-generation-prompt] [--template-kwargs '{"enable_thinking": false}']
  $PY tools/template_ref/render.py --model DIR --fixtures crates/engine/tests/data/templates --write
  $PY tools/template_ref/render.py --model DIR --fixtures crates/engine/tests/data/templates --json

`--write` (re)writes NAME.expected.txt (the exact rendering) or NAME.expected-error.txt (for
conversations the reference refuses: `raised: MESSAGE` when the template called
`raise_exception`, `error: TYPE: MESSAGE` otherwise). `--json` prints the same results as one JSON
object, for the live comparison in crates/engine/tests/template.rs. `--via-tokenizer` renders
through `AutoTokenizer.from_pretrained(DIR).apply_chat_template` itself (needs tokenizer.json in
DIR), to check that this script and transformers agree.

Fixture files: {"description": str, "messages": [...], "tools": [...]?,
"add_generation_prompt": bool (default true), "kwargs": {...}?}.
"""

import argparse
import functools
import glob
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jinja2  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template  # noqa: E402

hf_logging.set_verbosity_error()

NAMED_SPECIALS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]


def load_config(model_dir):
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    return {}


def load_templates(model_dir, cfg):
    """chat_template.jinja if present (it wins, as in transformers), else tokenizer_config's field."""
    p = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(p):
        with open(p, encoding="utf-8", newline="") as f:
            return f.read()
    t = cfg.get("chat_template")
    if isinstance(t, list):
        return {x["name"]: x["template"] for x in t}
    if t is None:
        raise SystemExit(f"{model_dir}: no chat template")
    return t


def pick_template(templates, tools):
    """transformers' get_chat_template for a named set."""
    if not isinstance(templates, dict):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise ValueError("This model has multiple chat templates with no default specified!")


def special_tokens_map(cfg):
    """transformers 5's `special_tokens_map`: named special tokens that are set, then
    `extra_special_tokens` (a dict of name -> token)."""

    def content(v):
        if isinstance(v, str):
            return v
        if isinstance(v, dict):
            return v.get("content")
        return None

    out = {}
    for k in NAMED_SPECIALS:
        c = content(cfg.get(k))
        if c is not None:
            out[k] = c
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, dict):
        for k, v in extra.items():
            c = content(v)
            if c is not None:
                out[k] = c
    return out


def parse_tool_arguments(messages):
    """lily's OpenAI-API step: string tool-call arguments -> JSON objects."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if not isinstance(calls, list):
            continue
        for j, call in enumerate(calls):
            target = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
            if isinstance(target, dict) and isinstance(target.get("arguments"), str):
                parsed = json.loads(target["arguments"])
                if not isinstance(parsed, dict):
                    raise ValueError(f"message {i}: tool call {j}: `arguments` must be a JSON object")
                target["arguments"] = parsed
    return messages


@functools.lru_cache(maxsize=None)
def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def render(model_dir, messages, tools=None, add_generation_prompt=True, kwargs=None, via_tokenizer=False):
    kwargs = dict(kwargs or {})
    if not isinstance(messages, list):
        raise TypeError("messages must be a list")
    if len(messages) == 0:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    messages = parse_tool_arguments(_normalize_chat_messages(messages))
    if via_tokenizer:
        return load_tokenizer(model_dir).apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    cfg = load_config(model_dir)
    template = pick_template(load_templates(model_dir, cfg), tools)
    template_kwargs = {**special_tokens_map(cfg), **kwargs}
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    return rendered[0]


def render_fixture(model_dir, fx, via_tokenizer=False):
    """{"text": rendering} or {"error": "TYPE: message", "raised": bool}."""
    try:
        text = render(
            model_dir,
            fx["messages"],
            tools=fx.get("tools"),
            add_generation_prompt=fx.get("add_generation_prompt", True),
            kwargs=fx.get("kwargs"),
            via_tokenizer=via_tokenizer,
        )
        return {"text": text}
    except Exception as e:  # noqa: BLE001 - every refusal is a result here
        raised = type(e) is jinja2.exceptions.TemplateError
        return {"error": f"{type(e).__name__}: {e}", "message": str(e), "raised": raised}


def fixture_files(d):
    return sorted(glob.glob(os.path.join(d, "*.json")))


def main():
    sys.stdout.reconfigure(encoding="utf-8", newline="")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint dir (chat_template.jinja / tokenizer_config.json)")
    ap.add_argument("--chat", help="chat JSON: {\"messages\": [...]} or a bare array")
    ap.add_argument("--tools", help="tools JSON: an array or {\"tools\": [...]}")
    ap.add_argument("--no-generation-prompt", action="store_true")
    ap.add_argument("--template-kwargs", default="{}", help="JSON object of extra template variables")
    ap.add_argument("--fixtures", help="directory of fixture *.json files")
    ap.add_argument("--write", action="store_true", help="with --fixtures: write the expected files")
    ap.add_argument("--json", action="store_true", help="with --fixtures: print all results as JSON")
    ap.add_argument("--via-tokenizer", action="store_true", help="render through AutoTokenizer.apply_chat_template")
    a = ap.parse_args()

    if a.fixtures:
        results = {}
        for p in fixture_files(a.fixtures):
            name = os.path.basename(p)[: -len(".json")]
            with open(p, encoding="utf-8") as f:
                fx = json.load(f)
            r = render_fixture(a.model, fx, a.via_tokenizer)
            results[name] = r
            if a.write:
                ok_path = os.path.join(a.fixtures, name + ".expected.txt")
                err_path = os.path.join(a.fixtures, name + ".expected-error.txt")
                if "text" in r:
                    with open(ok_path, "w", encoding="utf-8", newline="") as f:
                        f.write(r["text"])
                    if os.path.exists(err_path):
                        os.remove(err_path)
                else:
                    line = f"raised: {r['message']}" if r["raised"] else f"error: {r['error']}"
                    with open(err_path, "w", encoding="utf-8", newline="") as f:
                        f.write(line + "\n")
                    if os.path.exists(ok_path):
                        os.remove(ok_path)
        if a.json:
            json.dump(results, sys.stdout, ensure_ascii=False)
        elif a.write:
            n_err = sum(1 for r in results.values() if "error" in r)
            print(f"wrote {len(results)} fixtures ({n_err} expected errors)", file=sys.stderr)
        return

    if not a.chat:
        ap.error("--chat or --fixtures is required")
    with open(a.chat, encoding="utf-8") as f:
        chat = json.load(f)
    messages = chat.get("messages") if isinstance(chat, dict) else chat
    tools = chat.get("tools") if isinstance(chat, dict) else None
    if a.tools:
        with open(a.tools, encoding="utf-8") as f:
            tools = json.load(f)
        if isinstance(tools, dict):
            tools = tools.get("tools")
    kwargs = json.loads(a.template_kwargs)
    try:
        out = render(a.model, messages, tools, not a.no_generation_prompt, kwargs, a.via_tokenizer)
    except Exception as e:  # noqa: BLE001
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()
