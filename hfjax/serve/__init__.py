"""`hfjax serve`: a Tinker-compatible training and sampling service over hfjax's worker groups. One frozen base
model; each training client a LoRA adapter on it with its own Adam state; sampling on hfjax's engine with the
adapter version a client saved. The HTTP face (`app`, `service`, `wire`, `futures`, `registry`) speaks the Tinker
REST API to the official `tinker` SDK; the models (`adapter_worker`, `adapter_programs`, `sample_batches`) answer
the `backend.ServeBackend` calls on a local or Ray worker group (`worker_backend`). See docs/serve.md."""
