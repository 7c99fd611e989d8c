"""Tokenizers on the driver: HF ``tokenizer.json`` folders and GGUF-embedded vocabularies.

A GGUF vocabulary is converted once by transformers and cached as tokenizer.json under
~/.cache/pp_runtime, so later runs load it in milliseconds with the ``tokenizers`` library.
Chat templates are rendered with jinja2, as transformers does.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

CACHE_DIR = Path(os.environ.get("PP_RUNTIME_CACHE", Path.home() / ".cache" / "pp_runtime"))


class Tokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str | None, bos: str | None, eos: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._tok = HFTokenizer.from_file(tokenizer_json)
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            raise ValueError(f"{tokenizer_json} could not be read as a tokenizer ({' '.join(str(e).split())})") from None
        self.folder = Path(tokenizer_json).parent  # loadable by transformers.AutoTokenizer too
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos, eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Like transformers' ``tokenizer(text)``: the tokenizer's own BOS etc. are added (a
        LLaMA prompt without its BOS is a different prompt); chat templates already hold them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_output(self, ids: list[int]) -> str:
        """The text of generated tokens, as vLLM's detokenizer gives it: a character whose bytes
        are not all generated (the output ended mid-character at max_tokens) is left out rather
        than ending the text in U+FFFD."""
        return self.decode(ids).rstrip("\ufffd")

    def text_stream(self) -> "TextStream":
        return TextStream(self)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ValueError("this model has no chat template; drop --chat")
        import jinja2
        try:
            text = _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:  # a template's raise_exception(), or a broken template
            raise ValueError(f"chat template: {e}") from None
        return self.encode(text, add_special_tokens=False)


class TextStream:
    """The text of a growing output, decoded a few tokens at a time (vLLM's incremental
    detokenizer): each update decodes only the tokens since the last emitted character, with the
    few before them as context, since a tokenizer may decode a token differently at the start of
    a text (SentencePiece drops a word's leading space there). A character whose bytes are not all
    generated yet is held back, as ``decode_output`` leaves it out.

        stream = tok.text_stream()
        stream.update(ids_so_far)   # the text so far; ids_so_far only grows
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.text = tok, ""
        self._prefix = self._read = 0  # ids[prefix:read]: context already in text; ids[read:]: not yet

    def update(self, ids: list[int]) -> str:
        context = self.tok.decode(ids[self._prefix:self._read])
        full = self.tok.decode(ids[self._prefix:])
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self.text += full[len(context):]
            self._prefix, self._read = self._read, len(ids)
        return self.text


class StopStrings:
    """A request's stop strings (SamplingParams.stop), checked token by token as its text grows
    (a TextStream): the earliest one found ends the request, its text cut before it (after it
    with ``include``). Only the text's new end is searched, so a check costs what the new
    token's decoding does."""

    def __init__(self, tok: Tokenizer, stops: tuple[str, ...], include: bool) -> None:
        self.stream, self.stops, self.include = TextStream(tok), stops, include
        self._searched = 0  # the text's length at the last check

    def __call__(self, req: object, search: bool = True) -> bool:
        """Whether the request's text now holds a stop string (it then sets ``req.text``);
        ``search`` False: only read the new text, whatever it holds (vLLM's min_tokens)."""
        text = self.stream.update(req.output_token_ids)
        before, self._searched = self._searched, len(text)
        if not search:
            return False
        # A stop found now must end in the new text: each is looked for from len(s) - 1 before it.
        found = [(i, s) for s in self.stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not found:
            return False
        i, s = min(found)  # the earliest in the text; of two starting there, the shorter
        req.text = text[:i + len(s)] if self.include else text[:i]
        return True


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> object:
    """The environment transformers renders chat templates in: sandboxed (templates come from
    model files), trim/lstrip blocks, loop controls, and its helpers raise_exception,
    strftime_now and a tojson that does not HTML-escape."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


def load_tokenizer(kind: str, path: str) -> Tokenizer | None:
    """None for random presets (token ids only)."""
    if kind == "hf":
        return _from_folder(Path(path))
    if kind == "gguf":
        return _from_gguf(path)
    return None


def _from_folder(folder: Path) -> Tokenizer | None:
    if not (folder / "tokenizer.json").exists():
        return None
    conf = {}
    if (folder / "tokenizer_config.json").exists():
        try:
            conf = json.loads((folder / "tokenizer_config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder / 'tokenizer_config.json'} is not valid JSON ({e})") from None
        if not isinstance(conf, dict):
            raise ValueError(f"{folder / 'tokenizer_config.json'} must hold a JSON object")
    template = conf.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    return Tokenizer(str(folder / "tokenizer.json"), template, _token(conf.get("bos_token")),
                     _token(conf.get("eos_token")))


def _token(t: object) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def gguf_tokenizer_dir(path: str) -> Path:
    """Where the tokenizer of GGUF file ``path`` is cached; a changed file gets a new folder."""
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return CACHE_DIR / "tokenizers" / key


def _from_gguf(path: str) -> Tokenizer:
    folder = gguf_tokenizer_dir(path)
    if not (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer  # slow import, paid once per GGUF file
        p = Path(path)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
        except OSError:  # no writable cache (read-only home): convert again next time
            tmp = folder = Path(tempfile.mkdtemp(prefix="pp_runtime_tok_"))
            tok.save_pretrained(str(tmp))
        try:
            if tmp != folder:
                tmp.rename(folder)  # atomic: readers never see a half-written folder
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return _from_folder(folder)
