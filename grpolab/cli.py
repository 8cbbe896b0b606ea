"""grpolab command line."""

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="GRPO and friends for Hugging Face causal LMs.")


@app.command()
def demo() -> None:
    """Train the embedded tiny model with SFT then GRPO and print a before/after table."""
    typer.echo("grpolab demo arrives with the GRPO trainer.")


if __name__ == "__main__":
    app()
