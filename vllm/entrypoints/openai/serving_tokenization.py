"""/tokenize and /detokenize: the served model's tokenizer, so that clients count and build
prompts with the very tokens the engine will see. Neither runs the model."""

from vllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                              TokenizeResponse)
from vllm.entrypoints.openai.serving_engine import OpenAIServing, OpenAIServingError
from vllm.inputs import checked_text, checked_token_ids


class OpenAIServingTokenization(OpenAIServing):

    def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids, or the conversation's after the chat template; a prompt
        longer than max_model_len is not an error here: the response gives both lengths."""
        self.model_name(request.model)
        if request.messages is not None:
            _, ids = self.chat_prompt(request.messages, request, bool(request.add_special_tokens))
        else:
            try:
                text = checked_text(request.prompt)
            except ValueError as e:
                raise OpenAIServingError(str(e), param="prompt") from None
            add_special_tokens = request.add_special_tokens is not False
            ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of the token ids, special tokens included (as the prompt the engine reads)."""
        self.model_name(request.model)
        try:
            tokens = checked_token_ids(request.tokens, self.tokenizer, "tokens")
        except ValueError as e:
            raise OpenAIServingError(str(e), param="tokens") from None
        return DetokenizeResponse(prompt=self.tokenizer.decode(tokens))
