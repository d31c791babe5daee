/* PLACEHOLDER (being written by the server helper): the daemon's main. */
int main(void)
{
    return 1;
}
