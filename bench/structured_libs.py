"""`rtserve bench structured_libs`: xgrammar (the engine's grammar library) against llguidance and outlines-core on the
engine's own tokenizer (the embedded SmolLM2, loaded as `LLMEngine` loads it: `AutoTokenizer` of the resolved model
directory, the model config's vocab size and EOS ids).

What it measures, per library and schema:
- compile: building the grammar for one JSON schema from scratch (no cache): xgrammar `compile_json_schema`,
  llguidance `LLMatcher(tokenizer, grammar_from_json_schema(...))` (llguidance builds its lexer lazily, so part of its
  work lands in the first steps instead), outlines-core `build_regex_from_schema` + `Index` (the whole token automaton);
- mask per step: a batch of `--batch` rows, each decoding a valid instance of the schema token by token (rows cycle
  through a few instances, so they sit in different grammar states); per step, the time to fill all the rows' token
  bitmasks (one packed int32 bitmask, 32 tokens a word, the engine's layout) and, separately, to advance every row's
  matcher by its token. Mean over the steps where every row is still decoding, median over `--rounds` rounds; the
  libraries run interleaved inside each round, so a busy neighbour on the machine hits all of them alike;
- features: for each JSON-schema feature, a schema using it with one valid and one invalid instance: "yes" = compiles,
  accepts the valid one and rejects the invalid one; "ignored" = compiles but accepts the invalid one; "error" = will
  not compile it (message kept); "wrong" = rejects the valid one.

All three compile JSON with the engine's fixed separators (", " and ": "); outlines-core gets the whitespace pattern
" ?" (its regex has no way to fix one separator and forbid the other whitespace).

llguidance and outlines-core are not dependencies of rtserve; install them to run this
(`pip install llguidance==1.9.1 outlines-core==0.2.14`).
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from bench import report

SIMPLE = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
AIRPORTS = ["SFO", "JFK", "LHR", "CDG", "NRT", "SIN", "DXB", "FRA"]
TOOL_CALL = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "enum": AIRPORTS},
        "destination": {"type": "string", "enum": AIRPORTS},
        "date": {"type": "string"},
        "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
        "passengers": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                           "seat": {"type": "string", "enum": ["window", "aisle", "middle"]}},
            "required": ["name", "age", "seat"], "additionalProperties": False}},
        "flexible": {"type": "boolean"},
        "budget": {"type": "object",
                   "properties": {"amount": {"type": "number"}, "currency": {"type": "string",
                                                                               "enum": ["USD", "EUR", "JPY"]}},
                   "required": ["amount", "currency"], "additionalProperties": False},
    },
    "required": ["origin", "destination", "date", "cabin", "passengers", "flexible", "budget"],
    "additionalProperties": False,
}
MAX_LENGTH = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 256}}, "required": ["text"],
              "additionalProperties": False}

PROSE = ["The quick brown fox jumps over the lazy dog while the band plays a slow waltz in the park next door.",
         "Rain is expected after lunch, so bring an umbrella and leave the bicycle at home; trains run late today.",
         "Our meeting moved to Thursday at ten, room 4B, and the slides need one more pass before we send them out.",
         "She read the letter twice, folded it along the old creases, and put it back in the drawer with the keys."]
INSTANCES = {
    "simple": [{"name": "Ada Lovelace", "age": 36}, {"name": "Grace", "age": 85}, {"name": "Alan M. Turing", "age": 41},
               {"name": "Katherine Johnson", "age": 101}],
    "tool_call": [
        {"origin": "SFO", "destination": "NRT", "date": "2025-03-14", "cabin": "business",
         "passengers": [{"name": "Ada Lovelace", "age": 36, "seat": "window"}], "flexible": False,
         "budget": {"amount": 4200.5, "currency": "USD"}},
        {"origin": "CDG", "destination": "JFK", "date": "next Friday", "cabin": "economy",
         "passengers": [{"name": "Jean", "age": 40, "seat": "aisle"}, {"name": "Marie", "age": 38, "seat": "middle"}],
         "flexible": True, "budget": {"amount": 900, "currency": "EUR"}},
        {"origin": "LHR", "destination": "SIN", "date": "2025-12-01", "cabin": "premium_economy",
         "passengers": [{"name": "Sam", "age": 7, "seat": "window"}, {"name": "Alex", "age": 44, "seat": "aisle"},
                        {"name": "Kim", "age": 45, "seat": "middle"}], "flexible": True,
         "budget": {"amount": 3100, "currency": "USD"}},
        {"origin": "DXB", "destination": "FRA", "date": "tomorrow", "cabin": "first",
         "passengers": [{"name": "Omar", "age": 52, "seat": "window"}], "flexible": False,
         "budget": {"amount": 150000, "currency": "JPY"}},
    ],
    "max_length": [{"text": p} for p in PROSE],
}
SCHEMAS = {"simple": SIMPLE, "tool_call": TOOL_CALL, "max_length": MAX_LENGTH}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props), "additionalProperties": False}


FEATURES = {  # name -> (schema, valid instance, invalid instance)
    "$ref/$defs": ({**obj({"a": {"$ref": "#/$defs/point"}}), "$defs": {"point": obj({"x": {"type": "integer"}})}},
                   {"a": {"x": 1}}, {"a": {"x": "one"}}),
    "anyOf": (obj({"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"v": True}, {"v": "yes"}),
    "enum": (obj({"v": {"enum": ["red", "green"]}}), {"v": "red"}, {"v": "blue"}),
    "const": (obj({"v": {"const": "fixed"}}), {"v": "fixed"}, {"v": "other"}),
    "pattern": (obj({"v": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}), {"v": "ABC-12"}, {"v": "abc-12"}),
    "minLength/maxLength": (obj({"v": {"type": "string", "minLength": 2, "maxLength": 4}}), {"v": "abc"},
                            {"v": "abcdef"}),
    "minItems/maxItems": (obj({"v": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
                          {"v": [1, 2]}, {"v": [1, 2, 3]}),
    "minimum/maximum": (obj({"v": {"type": "integer", "minimum": 1, "maximum": 10}}), {"v": 5}, {"v": 11}),
    "additionalProperties false": (obj({"a": {"type": "integer"}}), {"a": 1}, {"a": 1, "b": 2}),
    "format (date)": (obj({"v": {"type": "string", "format": "date"}}), {"v": "2024-07-26"}, {"v": "yesterday"}),
}


def load_tokenizer():
    """The tokenizer, vocab size (the logits' width) and EOS ids exactly as the engine takes them."""
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id", tokenizer.eos_token_id)
    eos_ids = sorted(set(eos if isinstance(eos, list) else [eos]) - {None})
    return tokenizer, cfg["vocab_size"], eos_ids


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, back to bytes (SmolLM2's tokens are spelled in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos_ids):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.eos = eos_ids[0]

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def advance(self, m, token) -> bool:
        return m.accept_token(token)

    def accepts_end(self, m) -> bool:
        return m.accept_token(self.eos)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos_ids):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])
        self.options = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, m, bitmask, row):
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def advance(self, m, token) -> bool:
        return m.consume_token(token)

    def accepts_end(self, m) -> bool:
        return m.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size, eos_ids):
        import outlines_core
        self.oc = outlines_core
        decode = _byte_decoder()
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i in special or i >= vocab_size:
                continue
            tokens.setdefault(bytes(decode[ch] for ch in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos_ids[0], tokens)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=" ?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, g, bitmask, row):
        row_mask = bitmask[row]
        g.write_mask_into(row_mask.data_ptr(), row_mask.numel(), 4)

    def advance(self, g, token) -> bool:
        try:
            g.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def accepts_end(self, g) -> bool:
        return g.is_finished()


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def encode(tokenizer, value) -> list[int]:
    return tokenizer.encode(json.dumps(value), add_special_tokens=False)


def time_compile(lib, schema, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.compile(schema)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_steps(lib, grammar, sequences: list[list[int]], batch: int, vocab_size: int) -> tuple[float, float]:
    """Mean seconds per step to fill the bitmasks of `batch` rows, and to advance them, over the steps every row is
    still decoding."""
    rows = [sequences[j % len(sequences)] for j in range(batch)]
    matchers = [lib.matcher(grammar) for _ in range(batch)]
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill = advance = 0.0
    steps = min(map(len, rows))
    for step in range(steps):
        t0 = time.perf_counter()
        for j, m in enumerate(matchers):
            lib.fill(m, bitmask, j)
        t1 = time.perf_counter()
        for j, m in enumerate(matchers):
            if not lib.advance(m, rows[j][step]):
                raise AssertionError(f"{lib.name} rejected token {step} of its row {j}'s valid instance")
        advance += time.perf_counter() - t1
        fill += t1 - t0
    return fill / steps, advance / steps


def feature_support(lib, tokenizer) -> dict[str, str]:
    out = {}
    for name, (schema, valid, invalid) in FEATURES.items():
        try:
            grammar = lib.compile(schema)
        except Exception as e:   # noqa: BLE001 - any failure to compile is the answer
            out[name] = "error: " + (str(e).strip().splitlines() or [type(e).__name__])[-1][:80]
            continue

        def accepts(value) -> bool:
            m = lib.matcher(grammar)
            return all(lib.advance(m, t) for t in encode(tokenizer, value)) and lib.accepts_end(m)

        if not accepts(valid):
            out[name] = "wrong"
        else:
            out[name] = "ignored" if accepts(invalid) else "yes"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = report.parser("structured_libs", __doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="rows whose masks are filled per step")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the table shows the median")
    ap.add_argument("--compile-repeats", type=int, default=1, help="compiles per schema and round")
    ap.add_argument("--libs", default=",".join(LIBS), help="comma-separated subset of " + ", ".join(LIBS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the libraries' own fill is single-threaded "
                                                             "per row here)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, vocab_size, eos_ids = load_tokenizer()
    libs = []
    setup = {}
    for name in args.libs.split(","):
        t0 = time.perf_counter()
        libs.append(LIBS[name](tokenizer, vocab_size, eos_ids))
        setup[name] = time.perf_counter() - t0
    sequences = {s: [encode(tokenizer, v) for v in vals] for s, vals in INSTANCES.items()}
    compile_s: dict[tuple[str, str], list[float]] = {}
    fill_s: dict[tuple[str, str], list[float]] = {}
    advance_s: dict[tuple[str, str], list[float]] = {}
    grammars = {}
    progress = report.Progress("structured_libs rounds", total=args.rounds)
    for r in range(args.rounds):
        for schema_name, schema in SCHEMAS.items():
            for lib in libs:   # interleaved: each library in turn, every round
                key = (lib.name, schema_name)
                compile_s.setdefault(key, []).append(time_compile(lib, schema, args.compile_repeats))
                grammars[key] = lib.compile(schema)
                f, a = time_steps(lib, grammars[key], sequences[schema_name], args.batch, vocab_size)
                fill_s.setdefault(key, []).append(f)
                advance_s.setdefault(key, []).append(a)
        progress.advance("rounds done")
    progress.close("rounds done")
    print(f"\ntokenizer: {vocab_size} logits, eos {eos_ids}; batch {args.batch} rows; steps per schema: "
          + ", ".join(f"{s} {min(map(len, seqs))}" for s, seqs in sequences.items()))
    print("setup (tokenizer tables, once per tokenizer): "
          + ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in setup.items()))
    med_ms = {key: {"compile": statistics.median(compile_s[key]) * 1e3, "fill": statistics.median(fill_s[key]) * 1e3,
                    "advance": statistics.median(advance_s[key]) * 1e3} for key in compile_s}
    report.print_table(
        [report.Column("library"), report.Column("schema"), report.Column("compile", "ms"),
         report.Column(f"mask fill, {args.batch} rows", "ms/step", 3),
         report.Column(f"advance, {args.batch} rows", "ms/step", 3)],
        [[lib.name, schema_name, *med_ms[(lib.name, schema_name)].values()] for schema_name in SCHEMAS
         for lib in libs])
    support = {lib.name: feature_support(lib, tokenizer) for lib in libs}
    report.print_table([report.Column("feature")] + [report.Column(lib.name) for lib in libs],
                       [[feature] + [support[lib.name][feature] for lib in libs] for feature in FEATURES])
    if args.output:
        report.write_json(args.output, args, {
            "setup_s": setup, "steps": {s: min(map(len, seqs)) for s, seqs in sequences.items()},
            "median_ms": [{"library": lib, "schema": schema, **v} for (lib, schema), v in med_ms.items()],
            "rounds_s": [{"library": lib, "schema": schema, "compile": compile_s[(lib, schema)],
                          "fill": fill_s[(lib, schema)], "advance": advance_s[(lib, schema)]}
                         for lib, schema in compile_s],
            "features": support})
    path = report.plot_path(args)
    if path:
        def bars(what: str) -> dict:
            return {schema: {lib.name: med_ms[(lib.name, schema)][what] for lib in libs} for schema in SCHEMAS}
        report.save_plot(path, [
            report.Panel("grammar compile (one schema, no cache)", "bars", bars("compile"), ylabel="ms"),
            report.Panel(f"mask fill, {args.batch} rows", "bars", bars("fill"), ylabel="ms/step"),
            report.Panel(f"matcher advance, {args.batch} rows", "bars", bars("advance"), ylabel="ms/step")],
            f"rtserve bench structured_libs: median of {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
