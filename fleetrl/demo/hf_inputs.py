"""Inputs of the "your own model" example, built on this machine with no download (`examples/fleet.hf.yaml`).

    python -m fleetrl.demo.hf_inputs examples/hf        # writes examples/hf/model and prompts.jsonl
    python -m fleetrl.demo.hf_inputs examples/tools --rows tools   # the same for examples/fleet.tools.yaml
    python -m fleetrl.demo.hf_inputs examples/agent --rows arithmetic   # examples/fleet.agent.yaml

* a Hugging Face causal-LM folder: a Qwen2 (or Llama) architecture at random weights, saved in bf16
  as safetensors shards with an index, with a generation config listing two EOS ids;
* its tokenizer: a byte-level BPE trained on the spot by `tokenizers` on the example's own text,
  wrapped as a `PreTrainedTokenizerFast` with a ChatML chat template;
* a JSONL of chat prompts in TRL's conversational format (a `prompt` column of messages) with a
  `keyword` column that the example's reward function (`examples/hf/keyword_reward.py`) reads.

Tests build their model folders with the same functions, in temporary folders.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen2 folders ship it (without the default system message)."""
AGENT_CHAT_TEMPLATE = (
    # No `{%-` and a newline after a block tag only as {{ NL }}: transformers renders with trim_blocks.
    "{% set NL = '\\n' %}"
    "{% if tools %}<|im_start|>system{{ NL }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}{{ NL }}# Tools{{ NL }}<tools>{% for tool in tools %}{{ NL }}"
    "{{ tool | tojson }}{% endfor %}{{ NL }}</tools>{{ NL }}Call a tool as <tool_call>{{ NL }}"
    "{\"name\": ..., \"arguments\": {...}}{{ NL }}</tool_call><|im_end|>{{ NL }}"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system{{ NL }}{{ messages[0]['content'] }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}{{ NL }}{{ message.content }}<|im_end|>{{ NL }}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}{{ NL }}{{ message.content }}"
    "{% endif %}{% for call in message.tool_calls %}{% if call.function is defined %}{% set call = call.function %}"
    "{% endif %}{{ NL }}<tool_call>{{ NL }}"
    "{\"name\": \"{{ call.name }}\", \"arguments\": {{ call.arguments | tojson }}}"
    "{{ NL }}</tool_call>{% endfor %}<|im_end|>{{ NL }}"
    "{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}{{ NL }}<tool_response>{{ NL }}{{ message.content }}{{ NL }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)
"""Qwen2.5's tool-calling ChatML (Hermes `<tool_call>` JSON, tool results as `<tool_response>`), shortened:
the agent example's template (`--rows arithmetic`)."""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
KEYWORDS = ["red", "blue", "green", "gold", "pink", "gray", "teal", "lime"]
_FORMS = ["Say the word {k}.", "Write {k} a few times.", "Repeat after me: {k}", "Answer with {k} only."]
SYSTEM = "You are a helpful assistant."
_ARCHS = {"qwen2": ("Qwen2", True), "llama": ("Llama", False), "qwen3": ("Qwen3", True), "mistral": ("Mistral", False)}
"""arch -> (transformers class prefix, tied embeddings)."""


def example_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` chat prompts in TRL's conversational format, each with the `keyword` its reward looks for."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.choice(KEYWORDS)
        rows.append({"prompt": [{"role": "user", "content": rng.choice(_FORMS).format(k=k)}], "keyword": k})
    return rows


def tool_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` chat prompts of `examples/fleet.tools.yaml`: ask the lookup tool for an item's colour. Each row
    carries the `table` its environment's tool reads (examples/tools/lookup_env.py), shuffled per row,
    and the `item` asked about: the colour is in no prompt."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colours = rng.sample(KEYWORDS, len(KEYWORDS))
        item = f"item {rng.randrange(len(KEYWORDS))}"
        rows.append({"prompt": [{"role": "user", "content": f"What colour is {item}? Ask the lookup tool."}],
                     "item": item, "table": {f"item {i}": c for i, c in enumerate(colours)}})
    return rows


def arithmetic_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` chat prompts of `examples/fleet.agent.yaml`: a sum or a difference of two small numbers, with the
    `expression` and its `answer` as columns (examples/agent/calculator_agent.py reads them)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randrange(10, 60), rng.randrange(1, 40), rng.choice("+-")
        expression = f"{a} {op} {b}"
        rows.append({"prompt": [{"role": "user", "content": f"What is {expression}? Use the calculator."}],
                     "expression": expression, "answer": str(a + b if op == "+" else a - b)})
    return rows


def agent_corpus(seed: int = 0) -> list[str]:
    """Extra tokenizer text of the agent example: numbers, the prompts, the tool-call format."""
    rng = random.Random(seed)
    lines = [m["content"] for r in arithmetic_rows(200, seed) for m in r["prompt"]]
    lines += [" ".join(str(rng.randrange(100)) for _ in range(10)) for _ in range(200)]
    tool = ('{"type": "function", "function": {"name": "calculator", "description": "Evaluate a sum or a difference '
            'of two integers.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
            '"required": ["expression"]}}}')
    lines += ["You are a helpful assistant.\n# Tools\n<tools>\n" + tool + "\n</tools>\nCall a tool as <tool_call>\n"
              '{"name": ..., "arguments": {...}}\n</tool_call>',
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>',
              "<tool_response>\n19\n</tool_response>", "The calculator says 12 + 7 = 19. The answer is 19."] * 40
    return lines


def corpus(seed: int = 0) -> list[str]:
    """Text the tokenizer is trained on: the prompts, the chat roles, the keywords, some words."""
    rows = example_rows(400, seed)
    words = ["the", "a", "of", "to", "and", "is", "in", "it", "you", "that", "was", "for", "on", "are", "with",
             "as", "I", "his", "they", "be", "at", "one", "have", "this"]
    lines = [m["content"] for r in rows for m in r["prompt"]] + [SYSTEM, "user", "assistant", "system"]
    rng = random.Random(seed)
    lines += [" ".join(rng.choice(words + KEYWORDS) for _ in range(12)) for _ in range(400)]
    return lines


def build_tokenizer(out: pathlib.Path, vocab_size: int = 384, chat_template: str = CHAT_TEMPLATE,
                    extra: list[str] | None = None) -> Any:
    """Train a byte-level BPE on `corpus()`, give it the chat template, save it into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus() + (extra or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))
    return fast


def build_model_folder(out: str | pathlib.Path, *, arch: str = "qwen2", dtype: str = "bfloat16",
                       max_shard_size: str = "100KB", hidden_size: int = 64, layers: int = 2,
                       seed: int = 0, agent: bool = False) -> pathlib.Path:
    """A local HF causal-LM folder (`arch`: qwen2, llama, qwen3 or mistral) at random weights, saved in `dtype` as
    safetensors shards with an index, with its tokenizer, chat template and a generation config
    that lists two EOS ids (`<|im_end|>`, `<|endoftext|>`). `agent`: the tool-calling template and a tokenizer
    that knows numbers and the tool-call format (the agent example's)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path, 512, chat_template=AGENT_CHAT_TEMPLATE, extra=agent_corpus()) if agent else \
        build_tokenizer(path)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    common: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=im_end,
        pad_token_id=eot, bos_token_id=None,
    )
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch not in _ARCHS:
            raise ValueError(f"arch {arch!r}: one of {sorted(_ARCHS)}")
        prefix, tied = _ARCHS[arch]
        cfg = getattr(transformers, f"{prefix}Config")(tie_word_embeddings=tied, **common)
        model: Any = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return path


def write_prompts(path: pathlib.Path, n: int = 256, seed: int = 0, rows: str = "keywords") -> pathlib.Path:
    made = {"tools": tool_rows, "arithmetic": arithmetic_rows}.get(rows, example_rows)(n, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in made))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the inputs of examples/fleet.hf.yaml (no download)")
    parser.add_argument("folder", nargs="?", default="examples/hf", help="where to write model/ and prompts.jsonl")
    parser.add_argument("--arch", default="qwen2", choices=sorted(_ARCHS))
    parser.add_argument("--rows", default="keywords", choices=["keywords", "tools", "arithmetic"],
                        help="keywords: examples/fleet.hf.yaml's prompts; tools: examples/fleet.tools.yaml's; "
                             "arithmetic: examples/fleet.agent.yaml's (and the tool-calling chat template)")
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.folder)
    model = build_model_folder(folder / "model", arch=args.arch, agent=args.rows == "arithmetic")
    prompts = write_prompts(folder / "prompts.jsonl", rows=args.rows)
    print(json.dumps({"model": str(model), "prompts": str(prompts)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
