#include <iostream>
int main() { std::cout << "shoestring\n"; return 0; }
