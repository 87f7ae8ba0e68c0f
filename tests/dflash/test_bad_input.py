"""Bad requests fail early with a `ConfigError` naming the field."""

import pytest

from dflash_plugin.checkpoint import config_for_target, init_drafter
from dflash_plugin.errors import ConfigError
from dflash_plugin.generate import speculative_generate
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.sampling import SamplingParams
from dflash_plugin.target import TargetRunner


@pytest.fixture(scope="module")
def proposer(qwen3_target):
    cfg = config_for_target(qwen3_target.config, num_layers=1, block_size=8, mask_token_id=3)
    return DFlashProposer(init_drafter(cfg))


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_sampling_params(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("prompts,kwargs,field", [
    ([[]], {}, "prompt"),
    ([], {}, "prompts"),
    ([[1] * 256], {}, "prompt"),  # the tiny target has 256 positions
    ([[1] * 200], {"max_new_tokens": 100}, "max_new_tokens"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1, 2]], {"block_size": 1}, "block_size"),
    ([[1, 2]], {"block_size": 65}, "block_size"),
    ([[1, 500]], {}, "prompt"),
])
def test_bad_requests(qwen3_target, proposer, prompts, kwargs, field):
    with pytest.raises(ConfigError) as err:
        speculative_generate(qwen3_target, proposer, prompts, **{"max_new_tokens": 4, **kwargs})
    assert err.value.field == field
    assert field in str(err.value)


def test_target_layer_ids_out_of_range(qwen3_target):
    with pytest.raises(ConfigError, match="target_layer_ids"):
        TargetRunner(qwen3_target, (0, 4))  # the tiny target has 4 layers
