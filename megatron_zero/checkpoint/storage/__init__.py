"""How checkpoint files reach the disk and come back: tensors to bytes (tensor_io, torch_zip_writer), the
parallel writer and its async thread (writer), the commit protocol and `latest` (commit), the --save lock
(lock), per-file checksums and the manifest (checksum, manifest), verified reading (reader) and the
allow-list unpickler (safe_pickle). Knows files, not models."""
