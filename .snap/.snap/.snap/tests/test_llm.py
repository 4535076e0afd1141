"""The offline API on a tiny Qwen3-MoE checkpoint with the test tokenizer: tokens, text, stops, limits."""

import subprocess
import sys

import pytest
import torch
from reference import save_tiny
from test_qwen3_moe import tiny_qwen3_config
from tiny_tokenizer import write_test_tokenizer

from moetier.engine.sampling import SamplingParams
from moetier.errors import CheckpointError, ConfigError
from moetier.llm import LLM, resolve_dtype

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny(tiny_qwen3_config(), path)
    write_test_tokenizer(path, vocab_size=320)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, device="cpu", load_progress=False)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_tokens_match_transformers_generate(llm, checkpoint):
    from transformers import AutoModelForCausalLM

    prompt = random_prompt(12, seed=0)
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, **GREEDY))[0]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24)
    completion = ours.outputs[0]
    assert completion.token_ids == ref[0, len(prompt) :].tolist()
    assert len(set(completion.token_ids)) > 3  # a real continuation, not one repeated token
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert ours.prompt is None and ours.prompt_token_ids == prompt
    # Incremental detokenisation adds up to decoding the whole output at once.
    assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_model_loads_in_checkpoint_dtype_on_cpu(llm):
    assert llm.model.dtype == torch.float32 and llm.device.type == "cpu"
    assert llm.max_model_len == 512
    assert llm.eos_token_ids == {1}  # the test tokenizer's <｜end▁of▁sentence｜>


def test_text_prompt_is_encoded_and_decoded(llm):
    text = "Hello, world! The quick brown fox"
    out = llm.generate(text, SamplingParams(max_tokens=10, **GREEDY))[0]
    ids = llm.tokenizer.encode(text)
    assert out.prompt == text and out.prompt_token_ids == ids and ids[0] == llm.tokenizer.bos_token_id
    same = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=10, **GREEDY))[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids) != ""


def test_stop_string_truncates_text_and_finishes_with_stop(llm):
    prompt = {"prompt_token_ids": random_prompt(10, seed=1)}
    full = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    assert len(full.text) >= 8
    stop = full.text[len(full.text) // 2 :][:3]
    cut = full.text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, stop=["never appears \x00", stop], **GREEDY))[0]
    completion = out.outputs[0]
    assert completion.text == full.text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    # Generation ended at the token that completed the stop string, not later.
    assert completion.token_ids == full.token_ids[: len(completion.token_ids)]
    assert len(completion.token_ids) < len(full.token_ids)
    assert stop in llm.tokenizer.decode(completion.token_ids)
    assert stop not in llm.tokenizer.decode(completion.token_ids[:-1])


def test_stop_token_ids_and_eos(llm):
    prompt = {"prompt_token_ids": random_prompt(10, seed=2)}
    full = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0].token_ids
    target = full[5]
    first = full.index(target)
    out = llm.generate(prompt, SamplingParams(max_tokens=16, stop_token_ids=[target], **GREEDY))[0].outputs[0]
    assert out.token_ids == full[: first + 1]  # the stop token is kept in token_ids ...
    assert out.text == llm.tokenizer.decode(full[:first])  # ... but not in the text
    assert out.finish_reason == "stop" and out.stop_reason == target

    saved = llm.eos_token_ids
    try:
        llm.eos_token_ids = {target}  # pretend the model's EOS is that token
        eos = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0].outputs[0]
        assert eos.token_ids == full[: first + 1]
        assert eos.finish_reason == "stop" and eos.stop_reason is None
        ignored = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        assert ignored.outputs[0].token_ids == full
    finally:
        llm.eos_token_ids = saved


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate({"prompt_token_ids": random_prompt(5, seed=3)}, SamplingParams(max_tokens=7, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_max_model_len_caps_output_and_rejects_long_prompts(checkpoint):
    small = LLM(checkpoint, device="cpu", max_model_len=20, load_progress=False)
    out = small.generate({"prompt_token_ids": random_prompt(14, seed=4)}, SamplingParams(max_tokens=50, **GREEDY))
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"
    for length in (20, 25):
        with pytest.raises(ConfigError, match=f"prompt has {length} tokens but max_model_len is 20"):
            small.generate({"prompt_token_ids": random_prompt(length, seed=5)})
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 512"):
        LLM(checkpoint, device="cpu", max_model_len=1000, load_progress=False)


def test_several_prompts_with_their_own_params(llm):
    prompts = [
        {"prompt_token_ids": random_prompt(6, seed=6)},
        "def add(a, b):",
        {"prompt_token_ids": random_prompt(9, seed=7)},
    ]
    params = [
        SamplingParams(max_tokens=3, **GREEDY),
        SamplingParams(max_tokens=5, **GREEDY),
        SamplingParams(max_tokens=4, temperature=0.9, seed=5, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 4]
    assert [o.prompt for o in outs] == [None, "def add(a, b):", None]
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        alone = llm.generate(prompt, sp)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_seeded_sampling_is_reproducible(llm):
    prompt = {"prompt_token_ids": random_prompt(8, seed=8)}

    def sample(seed):
        sp = SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        return llm.generate(prompt, sp)[0].outputs[0].token_ids

    first = sample(21)
    assert sample(21) == first
    assert sample(22) != first
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0].token_ids
    assert first != greedy  # sampling at temperature 1.5 really samples


def test_chat_renders_the_template_once(llm):
    messages = [{"role": "user", "content": "Hello!"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, **GREEDY))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) <= 1
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ({"prompt_token_ids": []}, None, "non-empty"),
        ({"prompt_token_ids": [1, 320]}, None, "not in the vocabulary"),
        ({"prompt_token_ids": [1, -3]}, None, "not in the vocabulary"),
        (42, None, "must be a string or a dict"),
        (["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], "3 sampling params for 2 prompts"),
    ],
)
def test_bad_requests_raise_config_error(llm, prompts, params, message):
    with pytest.raises(ConfigError, match=message):
        llm.generate(prompts, params)


def test_missing_model_folder_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="not a model folder"):
        LLM(tmp_path / "nope", device="cpu")


def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, cpu) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, cuda) == torch.float16
    assert resolve_dtype("auto", {"dtype": "float8_e4m3fn"}, cpu) == torch.float32
    assert resolve_dtype("auto", {}, cuda) == torch.bfloat16
    assert resolve_dtype("fp16", {"dtype": "float32"}, cpu) == torch.float16
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("int3", {}, cpu)


def test_generation_config_supplies_default_sampling(llm):
    saved = llm.generation_config
    try:
        llm.generation_config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
        llm.generation_config = {"do_sample": False, "temperature": 0.6}
        assert llm.get_default_sampling_params().greedy
    finally:
        llm.generation_config = saved


def test_import_moetier_is_cheap_and_exports_the_api():
    code = (
        "import sys, moetier; assert 'torch' not in sys.modules, 'torch imported eagerly'; print(moetier.__version__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import moetier

    assert result.stdout.strip() == moetier.__version__ != ""
    assert moetier.LLM is LLM and moetier.SamplingParams is SamplingParams
    assert {"LLM", "SamplingParams", "RequestOutput"} <= set(dir(moetier))
    with pytest.raises(AttributeError):
        _ = moetier.not_a_name


@pytest.mark.gpu
def test_cuda_generation_agrees_with_cpu_and_reproduces(llm, checkpoint):
    prompt = {"prompt_token_ids": random_prompt(12, seed=9)}
    greedy = SamplingParams(max_tokens=16, **GREEDY)
    gpu = LLM(checkpoint, load_progress=False)  # defaults: cuda, the checkpoint's fp32
    assert gpu.device.type == "cuda" and gpu.model.dtype == torch.float32
    assert gpu.generate(prompt, greedy)[0].outputs[0].token_ids == llm.generate(prompt, greedy)[0].outputs[0].token_ids
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)
    first = gpu.generate(prompt, seeded)[0].outputs[0].token_ids
    assert gpu.generate(prompt, seeded)[0].outputs[0].token_ids == first
    bf16 = LLM(checkpoint, dtype="bf16", load_progress=False)
    out = bf16.generate(prompt, greedy)[0].outputs[0]
    assert bf16.model.dtype == torch.bfloat16 and len(out.token_ids) == 16 and out.finish_reason == "length"
