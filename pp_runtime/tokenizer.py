"""Tokenizers on the driver: HF ``tokenizer.json`` folders and GGUF-embedded vocabularies.

A GGUF vocabulary is converted once by transformers and cached as tokenizer.json under
~/.cache/pp_runtime, so later runs load it in milliseconds with the ``tokenizers`` library.
Chat templates are rendered with jinja2, as transformers does.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("PP_RUNTIME_CACHE", Path.home() / ".cache" / "pp_runtime"))


class Tokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str | None, bos: str | None, eos: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        self._tok = HFTokenizer.from_file(tokenizer_json)
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos, eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ValueError("this model has no chat template; drop --chat")
        import jinja2
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text)


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
        conf = json.loads((folder / "tokenizer_config.json").read_text())
    template = conf.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    return Tokenizer(str(folder / "tokenizer.json"), template, _token(conf.get("bos_token")),
                     _token(conf.get("eos_token")))


def _token(t: object) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


def _from_gguf(path: str) -> Tokenizer:
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = CACHE_DIR / "tokenizers" / key
    if not (folder / "tokenizer.json").exists():
        from transformers import AutoTokenizer  # slow import, paid once per GGUF file
        p = Path(path)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(folder)
        except OSError:  # another process cached it first
            pass
    return _from_folder(folder)
