"""Bad checkpoints (issue 13): every corrupt file is refused with its name and the field or tensor.

Each case is a copy of the embedded tiny checkpoint, broken in tmp_path. Most checks run before
any tensor data is read, so they are fast; the NaN/Inf cases load the (15 MB) weights.
"""
import json
import os

import ml_dtypes
import numpy as np
import pytest

import baro_jax
from baro_jax import config as C
from baro_jax import weights as W
from baro_jax.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from bad_input_util import ST, edit_config, read_st, tiny_copy, write_st

P = "model.language_model.layers.0."


# --- config.json ---------------------------------------------------------------------------
RP = "(qwen3_5_moe_text) rope_parameters: "
TOP = "(qwen3_5_moe_text): "


@pytest.mark.parametrize("change,msg", [
    # sizes: JSON integers in range (a float, even 2048.0 or 1e300, is never a size)
    (lambda r: r.update(num_attention_heads=0), TOP + "field 'num_attention_heads' must be an integer in [1, 4096], got int 0"),
    (lambda r: r.update(num_attention_heads=None), "required field 'num_attention_heads' is null"),
    (lambda r: r.update(num_key_value_heads="2"), "field 'num_key_value_heads' must be an integer in [1, 4096], got str '2'"),
    (lambda r: r.update(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (lambda r: r.update(hidden_size=2.5), "field 'hidden_size' must be an integer in [1, 65536], got float 2.5"),
    (lambda r: r.update(hidden_size=256.0), "field 'hidden_size' must be an integer in [1, 65536], got float 256.0"),
    (lambda r: r.update(hidden_size=True), "field 'hidden_size' must be an integer in [1, 65536], got bool True"),
    (lambda r: r.update(hidden_size=1 << 40), "field 'hidden_size' must be an integer in [1, 65536], got int 1099511627776"),
    (lambda r: r.update(num_experts=0), "field 'num_experts' must be an integer in [1, 65536], got int 0"),
    (lambda r: r.update(num_experts_per_tok=17), "num_experts_per_tok 17 must be in [1, num_experts=16]"),
    (lambda r: r.update(vocab_size=-5), "field 'vocab_size' must be an integer in [1, 16777216], got int -5"),
    (lambda r: r.update(vocab_size=[256]), "field 'vocab_size' must be an integer in [1, 16777216], got list [256]"),
    (lambda r: r.update(head_dim=10**30), "field 'head_dim' must be an integer in [1, 4096], got int 10000000000"),
    (lambda r: r.update(moe_intermediate_size=1e300), "field 'moe_intermediate_size' must be an integer in [1, 262144], got float 1e+300"),
    (lambda r: r.update(linear_key_head_dim=float("nan")), "field 'linear_key_head_dim' must be an integer in [1, 4096], got float nan"),
    (lambda r: r.update(num_hidden_layers=10**6), "field 'num_hidden_layers' must be an integer in [1, 4096], got int 1000000"),
    (lambda r: r.update(max_position_embeddings=0), "field 'max_position_embeddings' must be an integer in [1, 16777216], got int 0"),
    (lambda r: r.update(max_position_embeddings=1e300), "field 'max_position_embeddings' must be an integer in [1, 16777216], got float 1e+300"),
    (lambda r: r.update(max_position_embeddings=10**300), "field 'max_position_embeddings' must be an integer in [1, 16777216], got int 1000000"),
    (lambda r: r.update(linear_conv_kernel_dim=3), "linear_conv_kernel_dim 3 is not supported (only 4)"),
    # floats: finite, in the range the arithmetic needs
    (lambda r: r.update(rms_norm_eps=-1e-6), TOP + "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got float -1e-06"),
    (lambda r: r.update(rms_norm_eps=0), "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got int 0"),
    (lambda r: r.update(rms_norm_eps=1e30), "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got float 1e+30"),
    (lambda r: r.update(rms_norm_eps=1e-45), "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got float 1e-45"),
    (lambda r: r.update(rms_norm_eps="1e-6"), "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got str '1e-6'"),
    (lambda r: r.update(rms_norm_eps=float("inf")), "field 'rms_norm_eps' must be a number in [1.18e-38, 1], got float inf"),
    (lambda r: r["rope_parameters"].update(rope_theta=-10000.0), RP + "field 'rope_theta' must be a number finite and > 1, got float -10000.0"),
    (lambda r: r["rope_parameters"].update(rope_theta=1e-300), RP + "field 'rope_theta' must be a number finite and > 1, got float 1e-300"),
    (lambda r: r["rope_parameters"].update(rope_theta=1), RP + "field 'rope_theta' must be a number finite and > 1, got int 1"),
    (lambda r: r["rope_parameters"].update(rope_theta=float("nan")), RP + "field 'rope_theta' must be a number finite and > 1, got float nan"),
    (lambda r: r["rope_parameters"].update(rope_theta="big"), RP + "field 'rope_theta' must be a number finite and > 1, got str 'big'"),
    (lambda r: r["rope_parameters"].update(rope_theta=False), RP + "field 'rope_theta' must be a number finite and > 1, got bool False"),
    (lambda r: (r["rope_parameters"].pop("rope_theta"), r.update(rope_theta=0.5)), TOP + "field 'rope_theta' must be a number finite and > 1, got float 0.5"),
    (lambda r: r["rope_parameters"].update(partial_rotary_factor=2.0), RP + "field 'partial_rotary_factor' must be a number in (0, 1], got float 2.0"),
    (lambda r: r["rope_parameters"].update(partial_rotary_factor=0), RP + "field 'partial_rotary_factor' must be a number in (0, 1], got int 0"),
    (lambda r: r["rope_parameters"].update(partial_rotary_factor=0.01), "the rotary dim int(head_dim 64 x partial_rotary_factor 0.01) = 0 must be even and >= 2"),
    (lambda r: r["rope_parameters"].update(partial_rotary_factor=0.3), "= 19 must be even and >= 2"),
    (lambda r: r.update(rope_parameters=[1, 2]), TOP + "field 'rope_parameters' must be a JSON object, got list [1, 2]"),
    (lambda r: r.update(rope_parameters=0), TOP + "field 'rope_parameters' must be a JSON object, got int 0"),
    (lambda r: r["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn' is not supported"),
    # booleans: JSON booleans ("false" is a non-empty string)
    (lambda r: r.update(tie_word_embeddings="false"), TOP + "field 'tie_word_embeddings' must be a JSON boolean (true or false), got str 'false'"),
    (lambda r: r.update(tie_word_embeddings=0), "field 'tie_word_embeddings' must be a JSON boolean (true or false), got int 0"),
    (lambda r: r.update(attention_bias="false"), "field 'attention_bias' must be a JSON boolean (true or false), got str 'false'"),
    (lambda r: r.update(attention_bias=True), "attention_bias=true is not supported"),
    (lambda r: r.update(attn_output_gate="true"), "field 'attn_output_gate' must be a JSON boolean (true or false), got str 'true'"),
    (lambda r: r.update(hidden_act=["silu"]), "field 'hidden_act' must be a string, got list ['silu']"),
    # layer types: the right length and values
    (lambda r: r.update(layer_types="full_attention"), "field 'layer_types' must be a list of num_hidden_layers=8 entries"),
    (lambda r: r.update(layer_types=[]), "field 'layer_types' must be a list of num_hidden_layers=8 entries, each 'full_attention' or 'linear_attention', got 0 entries"),
    (lambda r: r["layer_types"].append("full_attention"), "got 9 entries"),
    (lambda r: r["layer_types"].__setitem__(5, "sliding_attention"), "got entry 5 str 'sliding_attention' (unknown layer type)"),
    (lambda r: r["layer_types"].__setitem__(2, None), "got entry 2 NoneType None (unknown layer type)"),
    (lambda r: (r.pop("layer_types"), r.update(full_attention_interval=0)), "field 'full_attention_interval' must be an integer in [1, 4096], got int 0"),
    (lambda r: (r.pop("layer_types"), r.update(full_attention_interval="4")), "field 'full_attention_interval' must be an integer in [1, 4096], got str '4'"),
])
def test_config_values_refused_with_file_and_field(tmp_path, change, msg):
    d = tiny_copy(tmp_path)
    edit_config(d, change)
    with pytest.raises(C.ConfigError) as ei:
        C.load_config(d)
    assert msg in str(ei.value)
    assert os.path.join(d, "config.json") in str(ei.value)  # the file is named


def test_config_not_json_or_not_an_object(tmp_path):
    d = tiny_copy(tmp_path)
    p = os.path.join(d, "config.json")
    with open(p, "w") as f:
        f.write('{"model_type": "qwen3_5_moe_text",')
    with pytest.raises(C.ConfigError, match=r"config\.json: not valid JSON \(.*line 1"):
        C.load_config(d)
    with open(p, "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(C.ConfigError, match="config.json must hold a JSON object, got list"):
        C.load_config(d)
    with open(p, "w") as f:
        json.dump({"model_type": "qwen3_5_moe", "text_config": [1]}, f)
    with pytest.raises(C.ConfigError, match="field 'text_config' must be a JSON object, got list"):
        C.load_config(d)


def test_max_context_beyond_the_model_refused_before_allocating(tmp_path):
    with pytest.raises(C.ConfigError, match=r"max_context \(--max-context\) 1000000000 is beyond the model's context of 8192"):
        C.load_config(bad_input_tiny(), 10**9)
    with pytest.raises(C.ConfigError, match=r"must be >= 1, got 0"):
        C.load_config(bad_input_tiny(), 0)
    with pytest.raises(C.ConfigError, match="beyond the model's context of 4096"):
        C.preset("tiny-random", 1 << 20)
    assert C.load_config(bad_input_tiny(), 1000).max_context == 1000


def bad_input_tiny():
    from bad_input_util import TINY
    return TINY


# --- safetensors header -------------------------------------------------------------------
def _corrupt(tmp_path, fn):
    d = tiny_copy(tmp_path)
    p = os.path.join(d, ST)
    h, data = read_st(p)
    out = fn(h, data)
    write_st(p, h, data if out is None else out)
    return d, p


def _header_error(d):
    cfg = C.load_config(d)
    with pytest.raises(W.WeightsError) as ei:
        W.load_params(d, cfg, progress=False)
    return str(ei.value)


def test_overlapping_offsets(tmp_path):
    def fn(h, data):  # A_log [4] f32 moved onto the first 16 bytes of input_layernorm
        h[P + "linear_attn.A_log"]["data_offsets"] = [0, 16]
    d, p = _corrupt(tmp_path, fn)
    msg = _header_error(d)
    assert p in msg and "overlaps tensor" in msg and "linear_attn.A_log" in msg, msg


def test_swapped_offsets(tmp_path):
    def fn(h, data):
        b, e = h[P + "linear_attn.A_log"]["data_offsets"]
        h[P + "linear_attn.A_log"]["data_offsets"] = [e, b]
    d, p = _corrupt(tmp_path, fn)
    msg = _header_error(d)
    assert "linear_attn.A_log" in msg and "begin > end" in msg, msg


def test_size_not_dtype_times_shape(tmp_path):
    def fn(h, data):
        h[P + "linear_attn.A_log"]["shape"] = [5]
    d, p = _corrupt(tmp_path, fn)
    msg = _header_error(d)
    assert "linear_attn.A_log" in msg and "has 16 bytes" in msg and "needs 20" in msg, msg


def test_gap_between_tensors(tmp_path):
    def fn(h, data):  # every tensor after the first shifted by 8 bytes: a hole, and 8 bytes more data
        for k, v in h.items():
            if k != "__metadata__" and v["data_offsets"][0] > 0:
                v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
        return data[:1024] + b"\0" * 8 + data[1024:]
    d, p = _corrupt(tmp_path, fn)
    assert "a gap of 8 bytes before tensor" in _header_error(d)


def test_truncated_file(tmp_path):
    d, p = _corrupt(tmp_path, lambda h, data: data[:-1000])
    msg = _header_error(d)
    assert "truncated safetensors file" in msg and p in msg and "layers.7.self_attn.v_proj.weight" in msg, msg


def test_trailing_bytes(tmp_path):
    d, p = _corrupt(tmp_path, lambda h, data: data + b"\0" * 64)
    assert "64 bytes after the last tensor" in _header_error(d)


@pytest.mark.parametrize("meta,msg", [
    ({"dtype": "BF16", "shape": [4]}, "needs dtype, shape and data_offsets"),
    ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}, "unknown dtype 'Q4'"),
    ({"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}, "bad shape"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, "bad data_offsets"),
    ([1, 2], "needs dtype, shape and data_offsets"),
])
def test_malformed_header_entries(tmp_path, meta, msg):
    def fn(h, data):
        h[P + "linear_attn.A_log"] = meta
    d, p = _corrupt(tmp_path, fn)
    got = _header_error(d)
    assert msg in got and "linear_attn.A_log" in got and p in got, got


def test_header_not_json_and_header_past_the_end(tmp_path):
    d = tiny_copy(tmp_path)
    p = os.path.join(d, ST)
    with open(p, "r+b") as f:
        f.seek(8)
        f.write(b"[[[[")
    assert "corrupt safetensors header" in _header_error(d)
    with open(p, "r+b") as f:
        f.write((10**8).to_bytes(8, "little"))
    assert "the header needs 100000008 bytes" in _header_error(d)


def test_index_json_errors(tmp_path):
    d = tiny_copy(tmp_path)
    idx = os.path.join(d, "model.safetensors.index.json")
    for text, msg in [("{not json", "not valid JSON"), ("[1, 2]", "a JSON object expected, got list"),
                      ('{"weight_map": []}', "has no weight_map"),
                      ('{"weight_map": {"a": 3}}', "bad entries for a")]:
        with open(idx, "w") as f:
            f.write(text)
        with pytest.raises(W.WeightsError) as ei:
            W.checkpoint_files(d)
        assert idx in str(ei.value) and msg in str(ei.value), str(ei.value)


def _index(d, shard):
    idx = os.path.join(d, "model.safetensors.index.json")
    h, _ = read_st(os.path.join(d, ST))
    names = [n for n in h if n != "__metadata__"]
    wm = {n: (shard if n == names[3] else ST) for n in names}
    with open(idx, "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return idx, names[3]


@pytest.mark.parametrize("where,why", [("../outside.safetensors", "climbs out with '..'"),
                                       ("sub/../../outside.safetensors", "climbs out with '..'"),
                                       ("ABS", "is an absolute path"),
                                       ("link.safetensors", "is a symlink to "),
                                       ("linkdir/outside.safetensors", "is a symlink to "),
                                       ("model\0.safetensors", "holds a NUL character")])
def test_weight_map_entry_outside_the_checkpoint_refused(tmp_path, where, why):
    d = tiny_copy(tmp_path)
    outside = os.path.join(str(tmp_path), "outside.safetensors")
    os.rename(os.path.join(d, ST), outside)  # a real shard: it would load if the entry were followed
    os.makedirs(os.path.join(d, "sub"))
    os.symlink(outside, os.path.join(d, "link.safetensors"))
    os.symlink(str(tmp_path), os.path.join(d, "linkdir"))
    entry = outside if where == "ABS" else where
    import shutil
    shutil.copy(outside, os.path.join(d, ST))
    idx, name = _index(d, entry)
    with pytest.raises(W.WeightsError) as ei:
        W.checkpoint_files(d)
    msg = str(ei.value)
    assert msg.startswith(f"{idx}: weight_map entry {name!r}: {entry!r} {why}"), msg
    assert f"a shard must be a file inside the checkpoint directory {d!r}" in msg
    with pytest.raises(W.WeightsError, match="weight_map entry"):
        W.load_params(d, C.load_config(d), progress=False)


def test_unindexed_weights_that_are_a_symlink_out_are_refused(tmp_path):
    d = tiny_copy(tmp_path)
    outside = os.path.join(str(tmp_path), "elsewhere.safetensors")
    os.rename(os.path.join(d, ST), outside)  # a real checkpoint's weights: they would load if followed
    os.symlink(outside, os.path.join(d, ST))
    single = os.path.join(d, ST)
    with pytest.raises(W.WeightsError) as ei:
        W.checkpoint_files(d)
    assert str(ei.value) == (f"{single} is a symlink to {outside}, outside it; the weights must be a file inside "
                             f"the checkpoint directory {d!r}"), str(ei.value)
    with pytest.raises(W.WeightsError, match="is a symlink to"):
        baro_jax.load(d)
    os.makedirs(os.path.join(d, "blobs"))  # a symlink that stays inside loads
    os.remove(single)
    os.rename(outside, os.path.join(d, "blobs", "w"))
    os.symlink(os.path.join("blobs", "w"), single)
    assert W.checkpoint_files(d) == [single]


def test_weight_map_inside_the_checkpoint_loads(tmp_path):
    """Entries that stay inside load: a sub directory, './', a symlink within, and the Hugging Face
    hub cache (snapshots/<rev>/ files are symlinks to the repository's blobs/)."""
    d = tiny_copy(tmp_path)
    os.makedirs(os.path.join(d, "sub"))
    os.symlink(os.path.join(d, ST), os.path.join(d, "sub", "in.safetensors"))
    for entry in ("./" + ST, "sub/in.safetensors"):  # the same file as model.safetensors: read once
        _index(d, entry)
        assert W.checkpoint_files(d) == [os.path.join(d, ST)]
    _index(d, ST)
    repo = os.path.join(str(tmp_path), "models--x--tiny")
    snap = os.path.join(repo, "snapshots", "abc123")
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snap)
    for fn in os.listdir(d):
        src = os.path.join(d, fn)
        if os.path.isfile(src) and not os.path.islink(src):
            blob = os.path.join(repo, "blobs", "sha-" + fn)
            os.rename(src, blob)
            os.symlink(os.path.join("..", "..", "blobs", "sha-" + fn), os.path.join(snap, fn))
    with open(os.path.join(snap, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    assert set(wm.values()) == {ST}
    assert W.checkpoint_files(snap) == [os.path.join(snap, ST)]
    cfg = C.load_config(snap)
    W.load_params(snap, cfg, progress=False)


# --- NaN / Inf weights --------------------------------------------------------------------------
def _poison(d, name, value):
    p = os.path.join(d, ST)
    h, data = read_st(p)
    b, e = h[name]["data_offsets"]
    dt = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}[h[name]["dtype"]]
    arr = np.frombuffer(data[b:e], dt).copy()
    arr[len(arr) // 2] = value
    data = data[:b] + arr.tobytes() + data[e:]
    write_st(p, h, data)


def test_nonfinite_weights_refused_with_the_tensor_name(tmp_path, monkeypatch, capsys):
    d = tiny_copy(tmp_path)
    _poison(d, P + "mlp.shared_expert.up_proj.weight", np.inf)  # part of a fused target (shared_gate_up)
    _poison(d, "model.language_model.layers.3.input_layernorm.weight", np.nan)
    with pytest.raises(W.WeightsError) as ei:
        baro_jax.load(d, backend="xla", progress=False)
    msg = str(ei.value)
    assert "2 tensor(s) hold NaN or Inf" in msg and d in msg
    assert P + "mlp.shared_expert.up_proj.weight" in msg
    assert "layers.3.input_layernorm.weight" in msg
    assert "shared_expert.gate_proj" not in msg  # narrowed to the guilty source
    assert "--allow-nonfinite" in msg
    # the opt-outs: the argument, and the env var
    eng = baro_jax.load(d, backend="xla", progress=False, allow_nonfinite=True)
    assert not np.isfinite(np.asarray(eng.params["layers"][3]["in_norm"])).all()
    monkeypatch.setenv("BARO_ALLOW_NONFINITE", "1")
    baro_jax.load(d, backend="xla", progress=False)
    # the CLI says it in one line, exit 2
    from baro_jax import generate

    monkeypatch.delenv("BARO_ALLOW_NONFINITE")
    rc = generate.main(["--model", d, "--backend", "xla", "--json", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "hold NaN or Inf" in err and "Traceback" not in err


def test_allow_nonfinite_must_be_a_boolean():
    cfg = C.load_config(bad_input_tiny())
    for v in ("false", "0", 0, 1, "yes"):
        with pytest.raises(TypeError) as ei:
            W.load_params(bad_input_tiny(), cfg, progress=False, allow_nonfinite=v)
        assert str(ei.value) == ("allow_nonfinite (--allow-nonfinite) must be True, False or None (the environment), "
                                 f"got {type(v).__name__} {v!r}")
        with pytest.raises(TypeError, match="allow_nonfinite"):
            W.params_from_state_dict({}, cfg, allow_nonfinite=v)


def test_nonfinite_in_state_dict():
    cfg = C.load_config(bad_input_tiny())
    from safetensors.numpy import load_file

    sd = load_file(os.path.join(bad_input_tiny(), ST))
    sd[P + "linear_attn.A_log"] = np.full((4,), np.nan, np.float32)
    with pytest.raises(W.WeightsError, match=r"state dict: 1 tensor\(s\) hold NaN or Inf.*\n  " + P + "linear_attn.A_log"):
        W.params_from_state_dict(sd, cfg)


# --- tokenizer files ---------------------------------------------------------------------------
def test_tokenizer_files(tmp_path, capsys):
    d = tiny_copy(tmp_path)
    tj = os.path.join(d, "tokenizer.json")
    with open(tj, "w") as f:
        f.write('{"version": "1.0", "model": 42}')
    with pytest.raises(TokenizerError, match="tokenizer.json: not a tokenizer.json the tokenizers library can read"):
        load_tokenizer(d)
    os.remove(tj)
    # missing tokenizer.json: bytes, with a one-time warning naming the directory
    assert isinstance(load_tokenizer(d), ByteTokenizer)
    assert isinstance(load_tokenizer(d), ByteTokenizer)
    err = capsys.readouterr().err
    assert err.count("has no tokenizer.json") == 1 and d in err
    d2 = tiny_copy(tmp_path, "ckpt2")
    tc = os.path.join(d2, "tokenizer_config.json")
    for text, msg in [("{bad", "not valid JSON"), ("[]", "a JSON object expected, got list"),
                      ('{"chat_template": 5}', "field 'chat_template' must be a string, got int"),
                      ('{"eos_token": ["<eos>"]}', "field 'eos_token' must be a string"),
                      ('{"eos_token": {"contents": "<eos>"}}', "field 'eos_token' must be a string or an object "
                                                               "with a string 'content', got dict"),
                      ('{"bos_token": {"content": 7}}', "field 'bos_token' must be a string or an object"),
                      ('{"eos_token": "<|no such token|>"}', "field 'eos_token' '<|no such token|>' is not a token of "),
                      ('{"chat_template": [{"name": "tool", "template": "x"}]}', "none named 'default'")]:
        with open(tc, "w") as f:
            f.write(text)
        with pytest.raises(TokenizerError) as ei:
            load_tokenizer(d2)
        assert tc in str(ei.value) and msg in str(ei.value), str(ei.value)
    with open(tc, "w") as f:
        f.write('{"chat_template": [{"name": "default", "template": "T{{ messages[0].content }}"}]}')
    assert load_tokenizer(d2).chat_template == "T{{ messages[0].content }}"


# --- chat templates ------------------------------------------------------------------------------
def _tok_dir(tmp_path, template=None, config=None):
    import shutil
    from bad_input_util import TINY

    d = str(tmp_path / "tok")
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(TINY, "tokenizer.json"), d)
    for fn, text in (("chat_template.jinja", template), ("tokenizer_config.json", config)):
        p = os.path.join(d, fn)
        if text is None:
            if os.path.exists(p):
                os.remove(p)
        else:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
    return d


def _chat_error(d, text="hi"):
    from baro_jax.tokenizer import apply_chat_template

    with pytest.raises(ValueError) as ei:
        apply_chat_template(load_tokenizer(d), text)
    return str(ei.value)


@pytest.mark.parametrize("template,msg", [
    ("{% for m in messages %}\n{{ m.content }}\n{% endfor", "chat template syntax error at line 3: unexpected end of template"),
    ("a\n{{ messages[0].content }\n", "chat template syntax error at line 2: unexpected '}'"),
    ("{% if %}", "chat template syntax error at line 1:"),
    ("one\ntwo\n{{ no_such_function('%Y') }}", "the chat template fails to render at line 3: UndefinedError: "
                                                "'no_such_function' is undefined"),
    ("{{ messages[3].content }}", "the chat template fails to render at line 1: UndefinedError"),
    ("\n\n{{ 1 // 0 }}", "the chat template fails to render at line 3: ZeroDivisionError"),
    ("{% if messages[0].role == 'user' %}\n{{ raise_exception('only system messages here') }}\n{% endif %}",
     "the chat template refused the conversation (line 2): only system messages here"),
    ("{{ messages.__class__.__mro__ }}", "the chat template fails to render at line 1: SecurityError"),
])
def test_chat_template_errors_name_the_file_and_line(tmp_path, template, msg):
    d = _tok_dir(tmp_path, template=template)
    got = _chat_error(d)
    assert got.startswith(os.path.join(d, "chat_template.jinja") + ": ") and msg in got, got
    assert "internal error" not in got
    # the same template in tokenizer_config.json: named as that file's field
    d = _tok_dir(tmp_path, config=json.dumps({"chat_template": template}))
    got = _chat_error(d)
    assert got.startswith(os.path.join(d, "tokenizer_config.json") + " field 'chat_template': ") and msg in got, got


def test_chat_template_helpers_as_in_transformers(tmp_path):
    """strftime_now, raise_exception, tojson (no HTML escaping), loop controls, {% generation %}
    and the special tokens render as transformers renders them."""
    import datetime

    from baro_jax.tokenizer import apply_chat_template

    template = ("{{ bos_token }}[{{ strftime_now('%Y-%m-%d') }}]{% for m in messages %}{% if loop.index > 1 %}"
                "{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
                "{{ messages | tojson }}{% if add_generation_prompt %}<go>{% endif %}{{ eos_token }}")
    d = _tok_dir(tmp_path, config=json.dumps({"chat_template": template, "bos_token": "S",  # tokens of the
                                              "eos_token": {"content": "E"}}))  # byte-level vocabulary
    before = datetime.date.today().isoformat()
    out = apply_chat_template(load_tokenizer(d), "a<b>&é")
    after = datetime.date.today().isoformat()
    assert out in (f'S[{day}]a<b>&é[{{"role": "user", "content": "a<b>&é"}}]<go>E' for day in (before, after)), out
    import transformers

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"), bos_token="S",
                                              eos_token="E", chat_template=template)
    assert hf.apply_chat_template([{"role": "user", "content": "a<b>&é"}], tokenize=False,
                                  add_generation_prompt=True) == out


def test_no_chat_template_is_said_plainly(tmp_path):
    from baro_jax.tokenizer import ByteTokenizer, apply_chat_template

    d = _tok_dir(tmp_path)
    assert _chat_error(d) == (f"--chat was given but the checkpoint {d!r} has no chat template (neither "
                              "tokenizer_config.json's 'chat_template' nor chat_template.jinja)")
    d = _tok_dir(tmp_path, config=json.dumps({"eos_token": "x"}))
    assert "has no chat template" in _chat_error(d)
    os.remove(os.path.join(d, "tokenizer.json"))
    assert _chat_error(d) == f"--chat was given but the checkpoint {d!r} has no tokenizer files, so no chat template"
    with pytest.raises(ValueError, match="this model has no chat template"):
        apply_chat_template(ByteTokenizer(), "x")


def test_chat_template_file_wins_over_the_config_entry(tmp_path):
    """Both present: chat_template.jinja is the template, as transformers reads the directory."""
    import transformers

    from baro_jax.tokenizer import apply_chat_template

    d = _tok_dir(tmp_path, template="file:{{ messages[0].content }}",
                 config=json.dumps({"chat_template": "config:{{ messages[0].content }}"}))
    tok = load_tokenizer(d)
    assert tok.chat_template_file == os.path.join(d, "chat_template.jinja")
    out = apply_chat_template(tok, "hi")
    assert out == "file:hi"
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == out
