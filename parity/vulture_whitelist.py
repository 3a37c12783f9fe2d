"""What make lint's dead-code check (vulture over ref/ and fast/) cannot see used, by kind.  Anything else it
reports is dead code: remove it, or add it here with its reason.  (A module's ``forward`` that nothing calls
is found by parity/test_single_file.py's test_module_forwards_are_called, which vulture cannot see.)"""
from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# public API: users and the tests call them, the files themselves do not
_.from_hf, _.token_logprobs, _.mtp_loss, _.sync_weights, _.mark_healthy, _.health_events, _.bytes_to, _.attach  # noqa: B018
# framework callbacks: torch.library's register_fake functions (all named _), autograd.Function.backward,
# the fake kernels of paged_varlen_attention's custom ops, a saved-tensor hook's unpack side
_._, _.backward, _._varlen_attn_fake, _._varlen_attn_out_fake, _._varlen_attn_bwd_fake, _.unpack_hook  # noqa: B018
# torch.distributed options set as attributes; Ray's placement field; a Completion's field (its readers are
# the callers); a state-dict hook's signature
_._timeout, _._devices, _.reduceOp, _.node_id, _.generator_id, _.local_metadata  # noqa: B018
# Triton autotune keys: kernel arguments only the autotuner reads
_.NHV, _.rows_bucket, _.keys_bucket  # noqa: B018
