"""The engine: requests in, `RequestOutput`s out, one step at a time; the tokenizer and the detokenizer."""
