"""The OpenAI protocol, for the server (`jaxhybrid.serve`) and the batch job (`jaxhybrid.batch_job`) alike.

`protocol` parses request bodies into `SamplingParams`; `render` turns them into engine prompts (the chat
template, through the engine's `PromptPreparer`) and checks them against max_model_len; `chat_parsing` and
`tool_choice` split chat output into reasoning, content and tool calls; `responses` shapes the bodies that go
back; `errors` holds the 400s and OpenAI's error bodies. Nothing here knows HTTP or imports `LLM`.
"""
