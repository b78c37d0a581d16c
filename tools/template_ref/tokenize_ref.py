#!/usr/bin/env python3
"""Reference tokenizer for lily's tokenizer round-trip tests: Python `tokenizers` (the same library
transformers uses) on a given tokenizer.json.

Reads one JSON request on stdin: {"tokenizer": PATH, "texts": [str...], "decode": [[id...]...]}
and prints {"ids": [[id...] per text], "decoded": [str per id list]}: encode without special-token
post-processing (`add_special_tokens=False`, as apply_chat_template's tokenization does) and
decode keeping special tokens (`skip_special_tokens=False`, as lily's decoder does).

Run with the oracle venv: `$(scripts/oracle-setup | tail -n1) tools/template_ref/tokenize_ref.py`.
"""

import json
import sys

from tokenizers import Tokenizer


def main():
    req = json.load(sys.stdin)
    tok = Tokenizer.from_file(req["tokenizer"])
    ids = [tok.encode(t, add_special_tokens=False).ids for t in req.get("texts", [])]
    decoded = [tok.decode(x, skip_special_tokens=False) for x in req.get("decode", [])]
    sys.stdout.reconfigure(encoding="utf-8")
    json.dump({"ids": ids, "decoded": decoded}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
