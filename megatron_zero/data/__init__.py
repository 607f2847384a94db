"""Data pipeline: tokenizers, Megatron's mmap indexed dataset, GPT samples, the sampler.

What the training loop calls:

    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
        args.data_path, args.split, args.seq_length, args.seed,
        [train_samples, valid_samples, test_samples])
    sampler = GlobalBatchSampler(len(train_ds), consumed_samples, micro_batch_size,
                                 global_batch_size, dp_rank, dp_size)
    for indices in sampler:
        batch = collate_gpt([train_ds[i] for i in indices])   # {'tokens', 'labels'}: int64 [b, s]
"""
from .builder import build_train_valid_test_datasets, parse_data_path, parse_split
from .collate import collate_gpt
from .errors import DataError
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from .sampler import GlobalBatchSampler
from .tokenizers import build_tokenizer

__all__ = ["build_train_valid_test_datasets", "parse_data_path", "parse_split", "collate_gpt",
           "DataError", "GPTDataset", "IndexedDataset", "IndexedDatasetBuilder", "GlobalBatchSampler",
           "build_tokenizer"]
