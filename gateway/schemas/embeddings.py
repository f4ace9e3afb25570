"""Body of `POST /v1/embeddings`: the input (text or token ids, one or a batch) checked and
bounded, the rest forwarded. An embedding holds only its input of a worker's cache."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, StrictInt, Tag

from gateway.schemas.common import RoutedRequest
from gateway.schemas.completions import PROMPT_SHAPE, TokenIds, one_string, prompt_count

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048
# As a completion's prompt, with a larger batch.
EmbeddingInput = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[TokenIds, Tag("list")]
    | Annotated[list[str], Tag("texts"), Field(min_length=1, max_length=MAX_INPUTS)]
    | Annotated[list[TokenIds], Tag("batch"), Field(min_length=1, max_length=MAX_INPUTS)],
    PROMPT_SHAPE,
    BeforeValidator(one_string),
]


class EmbeddingsRequest(RoutedRequest):
    model_config = ConfigDict(title="EmbeddingsIn")

    input: EmbeddingInput = Field(
        description=f"The text or token ids to embed, or a list of up to {MAX_INPUTS} of either"
    )

    @property
    def inputs(self) -> int:
        """How many it embeds (a batch's; else one)."""
        return prompt_count(self.input)

    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[StrictInt, Field(ge=1, le=65_536)] | None = None
    user: str | None = Field(default=None, description="A unique identifier of your end-user.")

    def end_user(self) -> str | None:
        return self.user
