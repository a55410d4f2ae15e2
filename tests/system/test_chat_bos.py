"""A model whose tokenizer adds a bos and whose chat template writes one too (Llama's way):
a chat prompt starts with exactly one bos, as in vLLM's chat path, and a completions prompt
has one unless the client sends `add_special_tokens: false`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_support import MODEL_NAME, call, start_http, stop_http
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from cachesvc.kv.types import WorkerId
from router.domain import ChatMessage, PromptInput
from workers.config import EngineConfig
from workers.text.tokenizer import Tokenizer

pytestmark = pytest.mark.system
BOS = "<|endoftext|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """In this module, the tiny model with a tokenizer that prepends a bos and a template that
    writes one (the routers `start_router` starts load their tokenizer from it)."""
    folder = tmp_path_factory.mktemp("tiny-llama-bos")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def bos_worker(ray_cluster: None, tiny_model_dir: Path) -> Iterator[dict[WorkerId, Any]]:
    import ray

    from workers.spawn import spawn_worker

    engine = EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256, num_threads=1)
    actor = spawn_worker("bos-0", engine, num_cpus=0.5, max_restarts=0)
    yield {WorkerId("bos-0"): actor}
    ray.kill(actor)


@pytest.fixture
def door(bos_worker: dict[WorkerId, Any], start_router: Any) -> Iterator[tuple[Any, Any]]:
    server = start_router(bos_worker)
    http = start_http(server)
    yield server, http
    stop_http(server, http)


def test_a_chat_prompt_starts_with_one_bos(door: tuple[Any, Any], tiny_model_dir: Path) -> None:
    server, http = door
    tokenizer = Tokenizer.from_path(tiny_model_dir)
    bos = tokenizer.bos_token_id
    assert bos is not None and tokenizer.encode("hi")[0] == bos, "the tokenizer adds a bos"
    messages = tuple(ChatMessage(m["role"], m["content"]) for m in MESSAGES)
    ids, _, text = server.run(server.router.tokenize(PromptInput(messages=messages)))
    assert text.startswith(BOS)
    assert ids[0] == bos and ids.count(bos) == 1, ids
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}
    status, _, data = call(http, "POST", "/v1/chat/completions", body)
    assert status == 200 and json.loads(data)["usage"]["prompt_tokens"] == len(ids)


def test_completions_add_a_bos_unless_told_not_to(
    door: tuple[Any, Any], tiny_model_dir: Path
) -> None:
    tokenizer = Tokenizer.from_path(tiny_model_dir)
    plain = tokenizer.encode("hello world", add_special_tokens=False)
    for add, expected in ((True, len(plain) + 1), (False, len(plain)), (None, len(plain) + 1)):
        body = {"model": MODEL_NAME, "prompt": "hello world", "max_tokens": 1}
        if add is not None:
            body["add_special_tokens"] = add
        status, _, data = call(door[1], "POST", "/v1/completions", body)
        assert status == 200, data
        assert json.loads(data)["usage"]["prompt_tokens"] == expected, add
